"""Checkpoint fragments by grid coordinate (format version 2): which slice of which global tensor each
fragment is, so a checkpoint written on one grid loads on any other.

A rank file lists fragments ``[name, start, numel]`` of the tensor it holds. Under ZeRO that tensor is
the whole parameter and ``start`` the data-parallel shard's offset (version 1 had only this). Under
tensor parallelism it is one part of the global parameter: the file's ``splits`` say ``name -> [dim,
index, parts]`` (plus the part sizes of a fused qkv or gate_up matrix, split part by part) and its
``shapes`` give the part's shape. Loading puts the parts of each name back
together (``Reassembly``), then cuts them again for the loading model's own split (``localize``), so
tp=2 -> tp=1, tp=1 -> tp=2 and any data-parallel count work alike. Replicated copies (the same part on
several tensor-parallel or data-parallel ranks) are read once: a file whose fragments are all known
already is not opened.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from deepshard.checkpoint import io as ckpt_io
from deepshard.placement import split_of
from deepshard.shard_state import FullState
from deepshard.tp.params import shard_of, unshard

Key = tuple[str, int]  # (parameter name, tensor-parallel part index)


def module_splits(module: torch.nn.Module) -> dict[str, list[int]]:
    """``name -> [dim, index, parts]`` (``+ [fused part sizes]``) for the tensor-parallel parameters."""
    out: dict[str, list[Any]] = {}
    for name, p in module.named_parameters():
        split = split_of(p)
        if split is not None:
            out[name] = [split.dim, split.index, split.parts] + ([list(split.fused)] if split.fused else [])
    return out


def wanted_names(module: torch.nn.Module) -> Optional[set[str]]:
    """The tensor names a model slice loads. A pipeline stage (a module that knows the whole model's keys
    through ``pipeline_state_keys()``) wants its own state-dict keys and parameter names only, so it
    reads only the rank files that hold them; None: every name in the checkpoint is this model's."""
    if not callable(getattr(module, "pipeline_state_keys", None)):
        return None
    own = set(module.state_dict(keep_vars=True))
    return own | {name for name, _ in module.named_parameters(remove_duplicate=False)}


def with_alias_sources(wanted: Optional[set[str]], aliases: dict[str, str]) -> Optional[set[str]]:
    """``wanted`` plus the names its tied-weight aliases are stored under (a tied copy is saved once)."""
    if wanted is None:
        return None
    return wanted | {aliases[name] for name in wanted if name in aliases}


def _numel(shape: Any) -> int:
    return int(torch.Size(shape).numel())


class Reassembly:
    """Collects rank files' fragments per (name, part) and joins the parts into global tensors."""

    def __init__(self, with_optimizer: bool) -> None:
        self.with_optimizer = with_optimizer
        self.values: dict[Key, torch.Tensor] = {}
        self.local_shapes: dict[Key, tuple[int, ...]] = {}
        self.splits: dict[str, tuple[int, int, Optional[tuple[int, ...]]]] = {}
        self.optim: dict[Key, dict[str, Any]] = {}
        self.kinds: dict[str, dict[str, str]] = {}
        self.seen: set[tuple[str, int, int]] = set()
        self.declared: dict[str, tuple[int, ...]] = {}
        self.covered: dict[str, int] = {}
        self.declared_keys: dict[Key, tuple[str, tuple[int, ...], Optional[list[Any]]]] = {}
        self.spans: dict[Key, list[tuple[int, int]]] = {}
        self.saved_splits: dict[str, Optional[list[Any]]] = {}

    @staticmethod
    def _label(name: str, index: int, info: dict[str, Any]) -> str:
        """A tensor-parallel part's name in coverage messages (``w[tp 1/2]``); a whole tensor's own name."""
        split = info.get("splits", {}).get(name)
        return f"{name}[tp {index}/{split[2]}]" if split else name

    def declare(self, info: dict[str, Any], wanted: Optional[set[str]]) -> None:
        """Note the shapes a rank file says its model slice has (what must be covered in the end)."""
        for name, shape in info["shapes"].items():
            if wanted is None or name in wanted:
                label = self._label(name, self._index(info, name), info)
                self.declared[label] = tuple(shape)
                split = info.get("splits", {}).get(name)
                self.declared_keys[(name, self._index(info, name))] = (label, tuple(shape), split)
                self.saved_splits[name] = split

    def coverage(self) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
        """``(declared shapes, elements found)`` per tensor or part, for ``matching.check_coverage``."""
        return self.declared, self.covered

    @staticmethod
    def _index(info: dict[str, Any], name: str) -> int:
        split = info.get("splits", {}).get(name)
        return int(split[1]) if split else 0

    def needs(self, info: dict[str, Any], wanted: Optional[set[str]]) -> bool:
        """True when the file holds a fragment not read yet (of a wanted name)."""
        return any((name, self._index(info, name), start) not in self.seen
                   for name, start, _ in info["fragments"] if wanted is None or name in wanted)

    def add(self, info: dict[str, Any], tensors: dict[str, torch.Tensor], wanted: Optional[set[str]] = None) -> None:
        """Take the file's fragments of the wanted names (all when None): a file also holding another
        pipeline stage's fragments must not leave that stage's tensors half-joined."""
        shapes = {k: tuple(v) for k, v in info["shapes"].items()}
        file_optim: dict[str, dict[str, Any]] = {}
        file_kinds: dict[str, dict[str, str]] = {}
        if self.with_optimizer:
            collect_optimizer_tensors(tensors, shapes, file_optim, file_kinds)
        for name, start, numel in info["fragments"]:
            if wanted is not None and name not in wanted:
                continue
            key = (name, self._index(info, name))
            if name in info.get("splits", {}):
                split = info["splits"][name]
                fused = tuple(int(s) for s in split[3]) if len(split) > 3 else None
                self.splits[name] = (int(split[0]), int(split[2]), fused)
            self.local_shapes[key] = shapes[name]
            full = self.values.setdefault(key, torch.zeros(_numel(shapes[name]), dtype=torch.float32))
            full[start:start + numel] = tensors[f"param/{name}@{start}"].float()
            if (name, key[1], start) not in self.seen:
                label = self._label(name, key[1], info)
                self.covered[label] = self.covered.get(label, 0) + int(numel)
                self.spans.setdefault(key, []).append((int(start), int(start) + int(numel)))
            self.seen.add((name, key[1], start))
            state = self.optim.setdefault(key, {})
            for skey, value in info["scalars"].get(f"{name}@{start}", {}).items():
                state[skey] = value
                self.kinds.setdefault(name, {})[skey] = "python"
            for skey, value in file_optim.get(name, {}).items():
                kind = file_kinds[name][skey]
                self.kinds.setdefault(name, {})[skey] = kind
                if kind == "elementwise":
                    dest = state.setdefault(skey, torch.zeros(_numel(shapes[name]), dtype=value.dtype))
                    dest[start:start + numel] = value[start:start + numel]
                else:
                    state[skey] = value

    def saved_split(self, name: str) -> Optional[list[Any]]:
        """The ``[dim, index, parts(, fused)]`` record of a part of ``name`` read so far (None: not split)."""
        return self.saved_splits.get(name)

    def fill_unread(self, fillable: Callable[[str], bool]) -> None:
        """Zeros for the declared tensors and tensor-parallel parts no file read gave values to, of the names
        ``fillable`` allows: a rank that loads a share (``checkpoint/share.py``) still hands its strategy
        every name, whole-shaped; only its own ranges hold the checkpoint's values."""
        for key, (_, shape, split) in self.declared_keys.items():
            if not fillable(key[0]):
                continue
            if key not in self.values:
                self.values[key] = torch.zeros(_numel(shape), dtype=torch.float32)
                self.local_shapes[key] = shape
            if split and key[0] not in self.splits:
                fused = tuple(int(s) for s in split[3]) if len(split) > 3 else None
                self.splits[key[0]] = (int(split[0]), int(split[2]), fused)
        for name, (_, count, _) in self.splits.items():
            ref = next((k for k in self.local_shapes if k[0] == name), None) if fillable(name) else None
            for i in range(count):
                if ref is not None and (name, i) not in self.values:  # parts cut evenly: the same shape
                    self.values[(name, i)] = torch.zeros(_numel(self.local_shapes[ref]), dtype=torch.float32)
                    self.local_shapes[(name, i)] = self.local_shapes[ref]

    def finish(self) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], dict[str, dict[str, str]],
                              dict[str, tuple[int, ...]]]:
        """Global tensors: ``(params, optim, kinds, shapes)`` as ``FullState`` holds them."""
        params: dict[str, torch.Tensor] = {}
        optim: dict[str, dict[str, Any]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for name in sorted({n for n, _ in self.values}):
            if name not in self.splits:
                shape = self.local_shapes[(name, 0)]
                params[name] = self.values[(name, 0)].view(shape)
                if self.optim.get((name, 0)):
                    optim[name] = self.optim[(name, 0)]
                shapes[name] = shape
                continue
            dim, count, fused = self.splits[name]
            missing = [i for i in range(count) if (name, i) not in self.values]
            if missing:
                present = sorted(set(range(count)) - set(missing))
                raise ckpt_io.CheckpointError(f"the checkpoint holds tensor-parallel parts {present} of '{name}' but not "
                                              f"{missing}: a rank file is missing")
            local = [self.values[(name, i)].view(self.local_shapes[(name, i)]) for i in range(count)]
            params[name] = unshard(local, dim, fused)
            shapes[name] = tuple(params[name].shape)
            if any(self.optim.get((name, i)) for i in range(count)):
                optim[name] = self._join_states(name, dim, count, fused)
        return params, optim, self.kinds, shapes

    def _join_states(self, name: str, dim: int, count: int, fused: Optional[tuple[int, ...]]) -> dict[str, Any]:
        first = next(self.optim[(name, i)] for i in range(count) if self.optim.get((name, i)))
        out: dict[str, Any] = {}
        for skey, value in first.items():
            if self.kinds.get(name, {}).get(skey) == "elementwise":
                pieces = [self._part_state(name, i, skey, value).view(self.local_shapes[(name, i)])
                          for i in range(count)]
                out[skey] = unshard(pieces, dim, fused).reshape(-1)
            else:
                out[skey] = value  # scalars (a step count) are the same on every part
        return out


    def _part_state(self, name: str, index: int, skey: str, like: torch.Tensor) -> torch.Tensor:
        """Part ``index``'s elementwise state ``skey``; zeros for a part this rank did not read (a share)."""
        state = self.optim.get((name, index), {}).get(skey)
        if state is not None:
            return state
        return torch.zeros(_numel(self.local_shapes[(name, index)]), dtype=like.dtype)


def collect_optimizer_tensors(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]],
                              optim: dict[str, dict[str, Any]], kinds: dict[str, dict[str, str]]) -> None:
    """A rank file's ``optim/<name>/<key>@<where>`` tensors into ``optim`` (whole per name and key: an
    elementwise slice placed at its offset) and their kinds into ``kinds``."""
    for flat_key, value in tensors.items():
        if not flat_key.startswith("optim/"):
            continue
        body, where = flat_key[len("optim/"):].rsplit("@", 1)
        name, key = body.rsplit("/", 1)
        state = optim.setdefault(name, {})
        if where == "scalar":
            state[key] = value.clone()
            kinds.setdefault(name, {})[key] = "scalar"
        elif where == "whole":
            state[key] = value.clone()
            kinds.setdefault(name, {})[key] = "whole"
        else:
            start = int(where)
            full = state.setdefault(key, torch.zeros(_numel(shapes[name]), dtype=value.dtype))
            full[start:start + value.numel()] = value
            kinds.setdefault(name, {})[key] = "elementwise"


def localize(full: FullState, module: torch.nn.Module) -> FullState:
    """Cut ``full``'s global tensors to ``module``'s own tensor-parallel parts (values and elementwise
    optimizer state), in place; returns ``full``."""
    wanted = wanted_names(module)
    if wanted is not None:  # a pipeline stage: other stages' tensors are not this model's
        for table in (full.params, full.optim, full.shapes):
            for name in [n for n in table if n not in wanted]:
                del table[name]
    for name, p in module.named_parameters():
        split = split_of(p)
        if split is None or name not in full.params:
            continue
        local_shape = tuple(getattr(p, "ds_shape", p.shape))
        value = full.params[name]
        if tuple(value.shape) == local_shape:
            continue
        if value.shape[split.dim] != local_shape[split.dim] * split.parts:
            raise ckpt_io.CheckpointError(
                f"checkpoint tensor '{name}' has shape {tuple(value.shape)}; the model's tensor-parallel part "
                f"{split.index}/{split.parts} along dim {split.dim} has shape {local_shape}, which does not divide it")
        full.params[name] = shard_of(value, split.dim, split.index, split.parts, split.fused).contiguous()
        for skey, state in full.optim.get(name, {}).items():
            if full.optim_kinds.get(name, {}).get(skey) == "elementwise":
                part = shard_of(state.view(value.shape), split.dim, split.index, split.parts, split.fused)
                full.optim[name][skey] = part.contiguous().reshape(-1)
        full.shapes[name] = local_shape
    return full
