"""Recognise a directory written by DeepSpeed's ``save_checkpoint`` and name its files.

A DeepSpeed save directory holds a ``latest`` file and tag folders (``global_step<N>``); a tag folder
holds ``mp_rank_XX_model_states.pt`` (ZeRO 0-2), ``zero_pp_rank_R_mp_rank_XX_model_states.pt`` (ZeRO-3,
one per data-parallel rank), ``[bf16_]zero_pp_rank_R_mp_rank_XX_optim_states.pt`` (one per
data-parallel rank) and, for a pipeline, ``layer_XX-model_states.pt`` per layer.
"""
from __future__ import annotations

import re
from pathlib import Path

from deepshard.checkpoint.io import CheckpointError

MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
LAYER_STATES = re.compile(r"^layer_(\d+)-model_states\.pt$")


def is_deepspeed_tag(directory: Path) -> bool:
    """True when ``directory`` is a tag folder DeepSpeed wrote (its model-states files, no deepshard
    ``engine.json``)."""
    if not directory.is_dir() or (directory / "engine.json").exists():
        return False
    return any(MODEL_STATES.match(p.name) or LAYER_STATES.match(p.name) for p in directory.iterdir())


def deepspeed_tag_dir(load_dir: Path, tag: str | None) -> Path | None:
    """The DeepSpeed tag folder ``load_checkpoint(load_dir, tag)`` means, or None when it is not DeepSpeed's.
    ``load_dir`` may also be a tag folder itself."""
    if is_deepspeed_tag(load_dir) and tag is None:
        return load_dir
    if tag is None:
        latest = load_dir / "latest"
        if not latest.is_file():
            return None
        tag = latest.read_text(encoding="utf-8", errors="replace").strip()
    candidate = load_dir / str(tag)
    return candidate if is_deepspeed_tag(candidate) else None


def model_state_files(tag_dir: Path, mp_rank: int = 0) -> list[Path]:
    """The model-states files of tensor-parallel rank ``mp_rank``: one (ZeRO 0-2) or one per
    data-parallel rank (ZeRO-3), ordered by rank."""
    found = sorted((int(m.group(1) or 0), p) for p in tag_dir.iterdir()
                   if (m := MODEL_STATES.match(p.name)) and int(m.group(2)) == mp_rank)
    if not found:
        raise CheckpointError(f"{tag_dir} holds no mp_rank_{mp_rank:02d}_model_states.pt file: it is not a complete "
                              "DeepSpeed checkpoint tag directory")
    return [p for _, p in found]


def optim_state_file(tag_dir: Path, dp_rank: int, mp_rank: int, bf16: bool) -> Path:
    return tag_dir / f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def optim_prefix_is_bf16(tag_dir: Path) -> bool:
    """Whether the optimizer files carry DeepSpeed's ``bf16_`` prefix (bf16 without ZeRO partitioning)."""
    names = [m for p in tag_dir.iterdir() if (m := OPTIM_STATES.match(p.name))]
    return bool(names) and all(m.group(1) for m in names)


def mp_ranks(tag_dir: Path) -> list[int]:
    """The model-parallel ranks (pipeline stages or tensor-parallel ranks) that wrote model states."""
    return sorted({int(m.group(2)) for p in tag_dir.iterdir() if (m := MODEL_STATES.match(p.name))})


def layer_files(tag_dir: Path) -> dict[int, Path]:
    """Pipeline checkpoints: layer index -> ``layer_XX-model_states.pt``."""
    return {int(m.group(1)): p for p in tag_dir.iterdir() if (m := LAYER_STATES.match(p.name))}
