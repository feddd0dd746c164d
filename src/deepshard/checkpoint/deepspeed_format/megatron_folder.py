"""The files of a Megatron-DeepSpeed 3D checkpoint folder and the layout they were saved at.

A tag folder holds ``mp_rank_XX_model_states.pt`` (one per pipeline x tensor-parallel position),
``[bf16_|fp16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt`` (one per rank) and, with pipeline parallelism,
``layer_NN-model_XX-model_states.pt`` (one per layer and tensor-parallel rank). The layout comes from the
``checkpoint_parallel_dimensions`` the model-state files record (DeepSpeed 0.19 writes it; every file must
have it and agree), else, for older folders, from the file counts. Files are read through
``safe_load.load_pt`` (no code from them is run).
"""
from __future__ import annotations

import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import torch

from deepshard.checkpoint.deepspeed_format.constants import (BF16_ZERO_FILE_PREFIX, CHECKPOINT_PARALLEL_DIMS,
                                                             CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE,
                                                             FP16_ZERO_FILE_PREFIX, LAYER_FILE_PREFIX,
                                                             MODEL_FILE_PREFIX, ZERO_FILE_PREFIX)
from deepshard.checkpoint.deepspeed_format.rank_maps import model_3d_desc, partition_data
from deepshard.checkpoint.deepspeed_format.safe_load import load_pt

__all__ = ["get_files", "get_files_with_prefix", "get_model_3d_descriptor", "get_model_3d_descriptor_from_metadata",
           "get_zero_files", "load_state", "merge_state", "model_3d_desc", "partition_data"]

Metadata = Sequence[tuple[str, dict[str, Any]]]
"""``(model-state file, what was kept of it)`` per ``mp_rank`` file, in file order."""


def check_folder(directory: str) -> None:
    if not os.path.isdir(directory):
        what = "does not exist" if not os.path.exists(directory) else "is not a folder"
        raise FileNotFoundError(f"DeepSpeed checkpoint folder {directory} {what}: pass a tag folder (the one "
                                "holding mp_rank_*_model_states.pt)")


def get_files(directory: str) -> list[str]:
    """Every file under ``directory`` (recursively), as paths joined onto it."""
    return [os.path.join(root, name) for root, _, names in os.walk(directory) for name in names]


def get_files_with_prefix(all_files: Sequence[str], prefix: str) -> list[str]:
    """The paths among ``all_files`` whose file name starts with ``prefix``, sorted."""
    return sorted(p for p in all_files if os.path.basename(p).startswith(prefix))


def get_zero_files(directory: str) -> list[str]:
    """The folder's ZeRO optimizer-state files (the first prefix present of plain, fp16 and bf16), in
    ``(data-parallel rank, model-parallel rank)`` order."""
    files = get_files(directory)
    for prefix in (ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, BF16_ZERO_FILE_PREFIX):
        found = get_files_with_prefix(files, prefix)
        if found:
            return _by_ranks(found, prefix)
    return []


def _by_ranks(files: list[str], prefix: str) -> list[str]:
    pattern = re.compile(re.escape(prefix) + r"(\d+)_" + re.escape(MODEL_FILE_PREFIX) + r"(\d+)")
    keyed = []
    for path in files:
        found = pattern.search(os.path.basename(path))
        if found is None:
            raise ValueError(f"{path}: no data- and model-parallel rank in the name (expected "
                             f"{prefix}<dp>_{MODEL_FILE_PREFIX}<mp>...)")
        keyed.append(((int(found.group(1)), int(found.group(2))), path))
    return [path for _, path in sorted(keyed)]


def load_state(path: str) -> Any:
    """One DeepSpeed ``.pt`` file, tensors on the CPU, through the allowlist (``safe_load.load_pt``)."""
    return load_pt(Path(path))


def _dims_of(model_file: str, dims: Any) -> tuple[int, int]:
    if not isinstance(dims, dict):
        raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} must be a dictionary in {model_file}, "
                           f"got {type(dims).__name__}.")
    values = []
    for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE):
        value = dims.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RuntimeError(f"Checkpoint {key} must be a positive integer in {model_file}, got {value!r}.")
        values.append(value)
    return values[0], values[1]


def get_model_3d_descriptor_from_metadata(file_list: Sequence[str], zero_file_list: Sequence[str],
                                          model_state_metadata: Metadata) -> model_3d_desc:
    """The saved layout, from the recorded dimensions (all files, agreeing) or, where no file records
    them, from the file counts: ``layer_01-*`` files are the tensor-parallel degree of a pipeline folder,
    else the ``mp_rank`` files are; the ZeRO files per model-parallel position are the data-parallel degree."""
    recorded = {f: m.get(CHECKPOINT_PARALLEL_DIMS) for f, m in model_state_metadata}
    present = {f: _dims_of(f, d) for f, d in recorded.items() if d is not None}
    n_models, n_zero = len(recorded), len(zero_file_list)
    if present:
        missing = [f for f, d in recorded.items() if d is None]
        if missing:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} is missing from model-state files: {missing}")
        if len(set(present.values())) != 1:
            raise RuntimeError(f"Checkpoint {CHECKPOINT_PARALLEL_DIMS} disagrees across model-state files: "
                               f"{list(present.values())}")
        pp, tp = next(iter(present.values()))
        if n_models != pp * tp:
            raise RuntimeError(f"Checkpoint model-state file count {n_models} does not match "
                               f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}.")
        if n_zero % (pp * tp):
            raise RuntimeError(f"Checkpoint ZeRO file count {n_zero} is not divisible by "
                               f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}.")
        return model_3d_desc(pp, tp, max(1, n_zero // (pp * tp)))
    first_layer = len(get_files_with_prefix(file_list, f"{LAYER_FILE_PREFIX}01"))
    tp = first_layer if first_layer else n_models
    pp = n_models // tp if first_layer and tp else 1
    if tp < 1 or pp < 1:
        raise RuntimeError(f"no {MODEL_FILE_PREFIX}*_model_states.pt files: not a DeepSpeed checkpoint tag folder")
    return model_3d_desc(pp, tp, max(1, n_zero // (pp * tp)))


def get_model_3d_descriptor(dir: str) -> model_3d_desc:  # noqa: A002 - DeepSpeed's parameter name
    """The layout the tag folder ``dir`` was saved at (each model-state file read once, for its dimensions)."""
    check_folder(dir)
    files = get_files(dir)
    metadata = [(f, {CHECKPOINT_PARALLEL_DIMS: _get(load_state(f), CHECKPOINT_PARALLEL_DIMS)})
                for f in get_files_with_prefix(files, MODEL_FILE_PREFIX)]
    return get_model_3d_descriptor_from_metadata(files, get_zero_files(dir), metadata)


def _get(state: Any, key: str) -> Any:
    return state.get(key) if isinstance(state, dict) else None


def merge_state(state_a: Any, state_b: Any, key_list: Sequence[str] = ()) -> Any:
    """Two ranks' states as one: tensors joined along dim 0, dicts key by key (a key only one side has is
    taken as it is), lists item by item, anything else (0-d tensors such as Adam's ``step`` too) taken from
    ``state_a``."""
    if type(state_a) is not type(state_b):
        raise ValueError(f"cannot merge {'.'.join(key_list) or 'the states'}: {type(state_a).__name__} and "
                         f"{type(state_b).__name__}")
    if isinstance(state_a, (dict, OrderedDict)):
        merged = type(state_a)((k, merge_state(state_a[k], v, [*key_list, str(k)]) if k in state_a else v)
                               for k, v in state_b.items())
        merged.update((k, v) for k, v in state_a.items() if k not in state_b)
        return merged
    if isinstance(state_a, (list, tuple)):
        if len(state_a) != len(state_b):
            raise ValueError(f"cannot merge {'.'.join(key_list) or 'the states'}: lists of {len(state_a)} and "
                             f"{len(state_b)} items")
        return type(state_a)(merge_state(a, b, key_list) for a, b in zip(state_a, state_b))
    if torch.is_tensor(state_a) and state_a.dim() > 0:
        return torch.cat([state_a, state_b], 0)
    return state_a
