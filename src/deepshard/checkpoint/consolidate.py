"""Consolidate a deepshard (or DeepSpeed) ZeRO checkpoint into one fp32 state dict, and write it like
Hugging Face does.

This is the logic behind ``deepshard.utils.zero_to_fp32`` (DeepSpeed's names and CLI live there).

Reading: a tag directory holds every rank's parameter fragments (``zero_rank<r>.*``) and rank 0's
``module_extra.safetensors`` (buffers and frozen parameters). :func:`consolidate` verifies the
manifest, reassembles each trainable parameter's fp32 master value from its fragments (any ZeRO
stage, any process count), points tied aliases at their canonical tensor and adds the buffers and
frozen parameters, upcast to fp32 when they are floating point (integer buffers keep their dtype).

Writing: :func:`write_state_dict` produces ``model.safetensors`` or ``pytorch_model.bin``, or, above
``max_shard_size``, numbered shards (``model-00001-of-00003.safetensors``) plus an index
(``model.safetensors.index.json``: ``{"metadata": {"total_size": bytes}, "weight_map": {key: file}}``),
the layout ``transformers.PreTrainedModel.from_pretrained`` reads. Every file is written atomically; the
old index is removed before new shards are written and stale shards of the same format after the new
index is in place, so an index never names a shard from another conversion.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from deepshard.checkpoint import io as ckpt_io
from deepshard.checkpoint.reader import load_full_state
from deepshard.shard_state import FullState
from deepshard.utils.logging import logger
from deepshard.utils.progress import progress

__all__ = ["Consolidated", "WrittenFiles", "resolve_tag_dir", "consolidate", "parse_size",
           "plan_shards", "write_state_dict", "FROZEN_META_KEY"]

# rank 0's ``meta`` entry listing the state_dict names of frozen parameters (absent in checkpoints
# written before it was recorded; then frozen parameters cannot be told from buffers)
FROZEN_META_KEY = "frozen_params"

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


@dataclass
class Consolidated:
    """A consolidated checkpoint: ``state_dict`` plus what the summary and the caller need to know."""

    state_dict: dict[str, torch.Tensor]
    tag_dir: Path
    trainable: list[str]
    aliases: dict[str, str]
    frozen: list[str] | None  # None: the checkpoint does not record which extra tensors are parameters
    excluded: list[str]


@dataclass
class WrittenFiles:
    """What :func:`write_state_dict` wrote: file names (in ``output_dir``), the index, the byte total."""

    output_dir: Path
    files: list[str]
    index: str | None
    total_size: int


# --------------------------------------------------------------------------------------------------
# locating the tag directory
# --------------------------------------------------------------------------------------------------

def _is_tag_dir(path: Path) -> bool:
    from deepshard.checkpoint.deepspeed_format import is_deepspeed_tag

    return (path / ckpt_io.MANIFEST_NAME).is_file() or any(path.glob("zero_rank*.json")) or is_deepspeed_tag(path)


def _tags_in(save_dir: Path) -> list[str]:
    return sorted(p.name for p in save_dir.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and _is_tag_dir(p))


def resolve_tag_dir(checkpoint_dir: str | Path, tag: str | None = None) -> Path:
    """The tag directory to read: ``checkpoint_dir/<tag>``, the tag in ``checkpoint_dir/latest`` when
    ``tag`` is None, or ``checkpoint_dir`` itself when it already is a tag directory."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {root} does not exist (or is not a directory); "
                                "pass the directory given to engine.save_checkpoint()")
    if tag is not None:
        tag = ckpt_io.validate_tag(str(tag))
        path = root / tag
        if path.is_dir():
            return path
        if root.name == tag and _is_tag_dir(root):
            return root
        raise FileNotFoundError(f"checkpoint tag {tag!r} does not exist in {root}; tags there: "
                                f"{_tags_in(root)}")
    latest = ckpt_io.read_latest(root)
    if latest is not None:
        path = root / latest
        if not path.is_dir():
            raise FileNotFoundError(f"{root / ckpt_io.LATEST_NAME} names tag {latest!r}, but {path} does not "
                                    f"exist; tags there: {_tags_in(root)}; pass tag=... explicitly")
        return path
    if _is_tag_dir(root):
        return root
    raise ValueError(f"{root} has no '{ckpt_io.LATEST_NAME}' file and no tag was given, so the checkpoint to "
                     f"consolidate is unknown; pass tag=... (-t TAG on the command line); tags there: "
                     f"{_tags_in(root)}")


# --------------------------------------------------------------------------------------------------
# consolidation
# --------------------------------------------------------------------------------------------------

def consolidate(checkpoint_dir: str | Path, tag: str | None = None,
                exclude_frozen_parameters: bool = False) -> Consolidated:
    """Verify the checkpoint's manifest and rebuild the model's full fp32 state dict from it."""
    from deepshard.checkpoint.deepspeed_format import is_deepspeed_tag

    tag_dir = resolve_tag_dir(checkpoint_dir, tag)
    if not is_deepspeed_tag(tag_dir):  # DeepSpeed's directories have no manifest; read as they are
        ckpt_io.verify_manifest(tag_dir)
    full = load_full_state(tag_dir, with_optimizer=False)
    frozen = _frozen_names(full)
    if exclude_frozen_parameters and frozen is None:
        logger.warning("exclude_frozen_parameters=True, but %s does not record which of its %d buffers and "
                       "frozen tensors are parameters: keeping all of them", tag_dir, len(full.module_extra))
    state: dict[str, torch.Tensor] = dict(full.params)
    for alias, canonical in full.aliases.items():
        if canonical in full.params:
            state[alias] = full.params[canonical]
    drop = set(frozen or []) if exclude_frozen_parameters else set()
    for key, value in full.module_extra.items():
        if key not in drop:
            state[key] = value.float() if value.is_floating_point() else value
    for alias, canonical in full.aliases.items():  # tied frozen parameters: one tensor, two names
        if alias in state and canonical in state and canonical not in full.params:
            state[alias] = state[canonical]
    excluded = sorted(k for k in full.module_extra if k in drop)
    return Consolidated(state, tag_dir, list(full.params), dict(full.aliases), frozen, excluded)


def _frozen_names(full: FullState) -> list[str] | None:
    names = full.meta.get(FROZEN_META_KEY) if isinstance(full.meta, dict) else None
    return None if names is None else [str(n) for n in names]


# --------------------------------------------------------------------------------------------------
# sharding
# --------------------------------------------------------------------------------------------------

def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string such as ``"5GB"`` (10**9), ``"500MB"``, ``"10KB"``,
    ``"2GiB"`` (2**30), ``"1000"``. Units are case-insensitive."""
    if isinstance(size, bool):
        raise TypeError(f"max_shard_size must be an int of bytes or a string like '5GB', got {size!r}")
    if isinstance(size, int):
        value = size
    elif isinstance(size, str):
        match = _SIZE_RE.match(size)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(f"max_shard_size {size!r} is not a size; write a number followed by one of "
                             "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), "
                             "e.g. '5GB' or '500MB'")
        value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    else:
        raise TypeError(f"max_shard_size must be an int of bytes or a string like '5GB', got "
                        f"{type(size).__name__} {size!r}")
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r} ({value} bytes)")
    return value


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return (storage.data_ptr(), storage.nbytes()) if storage.nbytes() else (id(t), 0)


def plan_shards(state_dict: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Split the keys into shards of at most ``max_bytes`` in order; tensors sharing storage stay in one
    shard and count once; a tensor larger than ``max_bytes`` gets a shard of its own."""
    units: dict[tuple[int, int], list[str]] = {}
    sizes: dict[tuple[int, int], int] = {}
    for key, tensor in state_dict.items():
        skey = _storage_key(tensor)
        units.setdefault(skey, []).append(key)
        sizes[skey] = max(sizes.get(skey, 0), tensor.numel() * tensor.element_size())
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for skey, keys in units.items():
        if current and used + sizes[skey] > max_bytes:
            shards.append(current)
            current, used = [], 0
        current += keys
        used += sizes[skey]
    if current or not shards:
        shards.append(current)
    return shards


def _unique_bytes(state_dict: dict[str, torch.Tensor]) -> int:
    seen: dict[tuple[int, int], int] = {}
    for tensor in state_dict.values():
        skey = _storage_key(tensor)
        seen[skey] = max(seen.get(skey, 0), tensor.numel() * tensor.element_size())
    return sum(seen.values())


# --------------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------------

def _names(safe: bool) -> tuple[str, str, str, re.Pattern[str]]:
    """(single file, shard name template, index name, pattern of this format's shard files)."""
    stem, ext = ("model", "safetensors") if safe else ("pytorch_model", "bin")
    return (f"{stem}.{ext}", stem + "-{:05d}-of-{:05d}." + ext, f"{stem}.{ext}.index.json",
            re.compile(rf"^{stem}-\d{{5}}-of-\d{{5}}\.{ext}$"))


def _prepare_for_format(state_dict: dict[str, torch.Tensor], safe: bool) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage: clone repeats. torch.save writes whole storages: compact views."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for key, tensor in state_dict.items():
        t = tensor.detach().cpu()
        skey = _storage_key(t)
        if safe and skey in seen:
            t = t.clone()
        elif not safe and t.untyped_storage().nbytes() > t.numel() * t.element_size():
            t = t.clone()
        seen.add(_storage_key(t))
        out[key] = t.contiguous()
    if not safe:  # keep tied tensors tied after compaction: same object in, same object out
        first: dict[int, torch.Tensor] = {}
        for key, tensor in state_dict.items():
            out[key] = first.setdefault(id(tensor), out[key])
    return out


def _write_one(path: Path, tensors: dict[str, torch.Tensor], safe: bool) -> None:
    if safe:
        ckpt_io.save_tensors(path, tensors, metadata={"format": "pt"}, record_name=False)
    else:  # package-internal use of io's atomic writer (temporary name, fsync, rename)
        ckpt_io._atomic_write(path, lambda tmp: torch.save(tensors, tmp),
                              sum(t.numel() * t.element_size() for t in tensors.values()))


def write_state_dict(state_dict: dict[str, torch.Tensor], output_dir: str | Path,
                     max_shard_size: int | str = "5GB", safe_serialization: bool = False) -> WrittenFiles:
    """Write ``state_dict`` into ``output_dir`` in the Hugging Face layout (see the module docstring)."""
    max_bytes = parse_size(max_shard_size)
    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    single, template, index_name, shard_re = _names(safe_serialization)
    prepared = _prepare_for_format(state_dict, safe_serialization)
    shards = plan_shards(prepared, max_bytes)
    (out_dir / index_name).unlink(missing_ok=True)
    files = [single] if len(shards) == 1 else [template.format(i + 1, len(shards)) for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for name, keys in progress(list(zip(files, shards)), f"writing {out_dir.name}", total=len(files), unit="file"):
        _write_one(out_dir / name, {k: prepared[k] for k in keys}, safe_serialization)
        weight_map.update({k: name for k in keys})
        logger.debug("wrote %s (%d tensors)", out_dir / name, len(keys))
    total = _unique_bytes(prepared)
    index = None
    if len(shards) > 1:
        ckpt_io.save_json(out_dir / index_name, {"metadata": {"total_size": total}, "weight_map": weight_map})
        index = index_name
    for stale in out_dir.iterdir():
        if stale.name not in files and (stale.name == single or shard_re.match(stale.name)):
            stale.unlink()
    return WrittenFiles(out_dir, files, index, total)
