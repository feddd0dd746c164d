"""A DeepSpeed tag directory written as a deepshard checkpoint (safetensors + JSON, no pickle), laid out
as ``dp`` rank files of a ZeRO ``stage`` run: each rank holds a contiguous ``1/dp`` share of the model's
flat fp32 parameters and optimizer state. deepshard loads it on any layout; the layout only decides how
the files are split.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from deepshard.checkpoint import io as ckpt_io
from deepshard.checkpoint.deepspeed_format.read import EngineRecord, read_engine_record, read_full_state
from deepshard.checkpoint.engine_checkpoint import ENGINE_JSON, ENGINE_TENSORS, FORMAT_VERSION
from deepshard.checkpoint.fragments import save_rank_fragments
from deepshard.checkpoint.state import flatten_state
from deepshard.shard_state import FragmentRecord, FullState, slice_state

Progress = Callable[[Iterable[Any], str], Iterable[Any]]


def write_deepshard(tag_dir: Path, save_dir: Path, tag: str, dp: int, stage: int, progress: Progress) -> Path:
    """Write ``save_dir/tag`` (staged, manifest, renamed into place) and ``save_dir/latest``."""
    if stage not in (0, 1, 2, 3) or dp < 1:
        raise ValueError(f"--stage {stage} --dp {dp}: the stage is 0-3 and the data-parallel size at least 1")
    full = read_full_state(tag_dir, with_optimizer=True)
    record = read_engine_record(tag_dir)
    staging = ckpt_io.staging_dir(save_dir, tag)
    names = list(full.params)
    files: list[str] = []
    for rank in progress(range(dp if stage > 0 else 1), "rank files"):
        files += save_rank_fragments(
            staging, rank, _records(full, names, rank, dp if stage > 0 else 1),
            {n: tuple(full.shapes[n]) for n in names}, full.param_groups if rank == 0 else None,
            dict(full.aliases), full.module_extra if rank == 0 else None,
            {"zero_stage": stage, "dp_world_size": dp, "frozen_params": []})
    files += _engine_files(staging, record, tag, stage, dp, _param_dtype(tag_dir, record))
    ckpt_io.write_manifest(staging, files)
    ckpt_io.commit_staging(staging, save_dir / tag)
    ckpt_io.write_latest(save_dir, tag)
    return save_dir / tag


def _records(full: FullState, names: list[str], rank: int, dp: int) -> list[FragmentRecord]:
    """Rank ``rank``'s contiguous share of the concatenated parameters, as fragments."""
    sizes = [int(full.params[n].numel()) for n in names]
    total = sum(sizes)
    share = -(-total // dp)
    lo, hi = rank * share, min((rank + 1) * share, total)
    out, offset = [], 0
    for name, n in zip(names, sizes):
        start, end = max(lo, offset), min(hi, offset + n)
        if start < end:
            value = full.params[name].reshape(-1)[start - offset:end - offset].float()
            state = slice_state(full, name, start - offset, end - start, value) if name in full.optim else {}
            out.append(FragmentRecord(name, start - offset, end - start, value.clone(), state))
        offset += n
    return out


def _param_dtype(tag_dir: Path, record: EngineRecord) -> str:
    cfg = record.ds_config or {}
    if (cfg.get("bf16") or {}).get("enabled") or (cfg.get("bfloat16") or {}).get("enabled"):
        return str(torch.bfloat16)
    return str(torch.float16) if (cfg.get("fp16") or {}).get("enabled") else str(torch.float32)


def _engine_files(staging: Path, record: EngineRecord, tag: str, stage: int, dp: int, dtype: str) -> list[str]:
    tensors, skeleton = flatten_state({"scheduler": record.lr_scheduler, "client_state": record.client_state})
    meta = {"format": "deepshard-engine", "version": FORMAT_VERSION, "tag": tag,
            "global_steps": record.global_steps, "global_samples": record.global_samples,
            "micro_steps": record.global_steps, "skipped_steps": record.skipped_steps,
            "loss_scaler": record.loss_scaler, "zero_stage": stage, "dp_world_size": dp,
            "grid": {"pp": 1, "dp": dp, "tp": 1}, "param_dtype": dtype, "state": skeleton}
    ckpt_io.save_tensors(staging / ENGINE_TENSORS, tensors)
    ckpt_io.save_json(staging / ENGINE_JSON, meta)
    return [ENGINE_TENSORS, ENGINE_JSON]
