"""The checkpoint format shared by every ZeRO stage: parameter *fragments* keyed by name and offset.

Each rank writes ``zero_rank<r>.safetensors`` + ``zero_rank<r>.json`` holding the fp32 values and the
optimizer state of the fragments it owns (stage 0: rank 0 owns every parameter whole; stages 1-2: each
rank its partition). Rank 0 also writes ``module_extra.safetensors``: buffers and frozen parameters.
Loading reassembles full tensors per parameter name from all ranks' files (``read_fragments``), and a
strategy then takes the slices it owns, so a checkpoint written by any stage on any number of processes
loads into any stage on any number of processes directly, with no conversion step.

Tensor keys: ``param/<name>@<start>`` (fp32 values), ``optim/<name>/<key>@<start>`` (an elementwise
state slice), ``optim/<name>/<key>@scalar`` (a 0-d state such as Adam's ``step``) and
``optim/<name>/<key>@whole`` (a non-elementwise state of a parameter owned whole).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from deepshard.checkpoint import io as ckpt_io
from deepshard.checkpoint import schema
from deepshard.checkpoint.layout import Reassembly, localize, wanted_names, with_alias_sources
from deepshard.checkpoint.matching import check_coverage
from deepshard.shard_state import FragmentRecord, FullState
from deepshard.utils.progress import progress

MODULE_EXTRA = "module_extra.safetensors"
_RANK_JSON = re.compile(r"^zero_rank(\d+)\.json$")
_EXTRA = re.compile(r"^module_extra(_rank\d+)?\.safetensors$")
FORMAT_VERSION = 2
"""1: fragments of whole tensors. 2: a fragment may be of a tensor-parallel part: the rank file's
``splits`` maps a name to ``[dim, index, parts]`` and ``shapes`` holds the part's shape; ``coord``
records the writer's grid coordinate. Version-1 files have neither and load as before."""


def extra_file(rank: int) -> str:
    """Buffers and frozen weights of one model slice: written by the first data-parallel rank of each
    (pipeline, tensor) slice; global rank 0 keeps the version-1 name."""
    return MODULE_EXTRA if rank == 0 else f"module_extra_rank{rank}.safetensors"


def rank_files(rank: int) -> tuple[str, str]:
    return f"zero_rank{rank}.safetensors", f"zero_rank{rank}.json"


def save_rank_fragments(directory: Path, rank: int, records: list[FragmentRecord],
                        shapes: dict[str, tuple[int, ...]], param_groups: list[dict[str, Any]] | None,
                        aliases: dict[str, str], module_extra: dict[str, torch.Tensor] | None,
                        meta: dict[str, Any], splits: dict[str, list[int]] | None = None,
                        coord: dict[str, int] | None = None) -> list[str]:
    """Write this rank's fragments (``rank``: the global rank, the file name); returns the file names.
    ``splits``: the tensor-parallel parts among them, ``name -> [dim, index, parts]``."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for rec in records:
        tensors[f"param/{rec.name}@{rec.start}"] = rec.value.detach().reshape(-1)
        whole = rec.start == 0 and rec.numel == _numel(shapes[rec.name])
        for key, value in rec.state.items():
            if not torch.is_tensor(value):
                scalars.setdefault(f"{rec.name}@{rec.start}", {})[key] = value
            elif value.dim() == 0:
                tensors[f"optim/{rec.name}/{key}@scalar"] = value.detach()
            elif value.numel() == rec.numel:
                tensors[f"optim/{rec.name}/{key}@{rec.start}"] = value.detach().reshape(-1)
            elif whole:
                tensors[f"optim/{rec.name}/{key}@whole"] = value.detach()
            else:
                raise ValueError(
                    f"optimizer state '{key}' of parameter '{rec.name}' has shape {tuple(value.shape)}, which is "
                    f"not elementwise (the fragment has {rec.numel} elements); optimizers with factored or "
                    "per-layer state cannot be partitioned by ZeRO stages 1-3: use stage 0")
    tensor_file, json_file = rank_files(rank)
    ckpt_io.save_tensors(directory / tensor_file, tensors)
    info = {"rank": rank, "version": FORMAT_VERSION, "fragments": [[r.name, r.start, r.numel] for r in records],
            "scalars": scalars, "shapes": {k: list(v) for k, v in shapes.items()},
            "order": list(shapes), "aliases": aliases,
            "meta": meta, "splits": splits or {}, "coord": coord or {}}
    if param_groups is not None:
        info["param_groups"] = param_groups
    ckpt_io.save_json(directory / json_file, info)
    files = [tensor_file, json_file]
    if module_extra is not None:
        ckpt_io.save_tensors(directory / extra_file(rank), module_extra)
        files.append(extra_file(rank))
    return files


def _numel(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def read_fragments(directory: Path, with_optimizer: bool = True, module: torch.nn.Module | None = None) -> FullState:
    """Reassemble full fp32 parameters (and optimizer state) from a deepshard tag's rank files (any
    format: ``checkpoint.reader.load_full_state``).

    Tensor-parallel parts are put back together along their split dimension (global tensors). With
    ``module``, only the files holding tensors that module has are read (a pipeline stage reads its own
    stage's files; replicated copies are read once), and the result is cut back to ``module``'s own
    tensor-parallel parts (``checkpoint/layout.py``), ready for a strategy to take its slices."""
    json_files = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _RANK_JSON.match(p.name)))
    if not json_files:
        raise ckpt_io.CheckpointError(
            f"{directory} holds no zero_rank*.json files: it is not a deepshard checkpoint tag directory "
            "(pass the directory that contains the tag folders and the 'latest' file, or the tag itself)")
    infos = [(rank, schema.check_rank_info(path, ckpt_io.load_json(path), rank)) for rank, path in json_files]
    aliases: dict[str, str] = {}
    for _, info in infos:
        aliases.update(info.get("aliases", {}))
    wanted = with_alias_sources(wanted_names(module), aliases) if module is not None else None
    parts = Reassembly(with_optimizer)
    groups, meta = None, {}
    saved_world = 0
    ordered = sorted(infos, key=lambda ri: (_foreign_fragments(ri[1], wanted), ri[0]))
    for rank, info in progress(ordered, f"reading {directory.name}", total=len(ordered), unit="file"):
        meta = info.get("meta", meta) if rank == 0 else meta
        groups = groups if groups is not None else info.get("param_groups")  # this slice's own file first
        saved_world = max(saved_world, int(info.get("meta", {}).get("dp_world_size", 0) or 0))
        parts.declare(info, wanted)
        if not parts.needs(info, wanted):
            continue  # another stage's tensors, or copies read already: the tensor file is not opened
        parts.add(info, ckpt_io.load_tensors(directory / rank_files(rank)[0]), wanted)
    check_coverage(directory, *parts.coverage(), [r for r, _ in json_files], saved_world or None)
    params, optim, kinds, shapes = parts.finish()
    module_extra: dict[str, torch.Tensor] = {}
    for extra in sorted(p for p in directory.iterdir() if _EXTRA.match(p.name)):
        module_extra.update(ckpt_io.load_tensors(extra, names=wanted))
    full = FullState(params, optim, kinds, groups, module_extra, aliases, shapes, meta)
    return localize(full, module) if module is not None else full


def _foreign_fragments(info: dict[str, Any], wanted: set[str] | None) -> int:
    """How many of a rank file's fragments the loading model slice does not want: files of this slice's
    own tensors are read first, so a copy it shares with another slice (a tied layer) comes from them."""
    return 0 if wanted is None else sum(1 for name, _, _ in info["fragments"] if name not in wanted)
