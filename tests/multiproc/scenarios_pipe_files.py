"""A 2-stage pipeline's files: ``save_16bit_model`` writes every stage's layers into one file on the first
rank, and ``load_checkpoint`` reads on each stage only the rank files holding that stage's tensors."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from tests.multiproc.scenarios_pipe import _data, _engine


def pipe_files_world(rank: int, world: int, directory: str) -> dict[str, Any]:
    """pp=2, ZeRO-1: one batch, then the 16-bit file and a checkpoint; a fresh engine loads it while every
    tensor-file read is recorded."""
    from deepshard.checkpoint import io as ckpt_io

    model, engine = _engine(2, 2, zero=1)
    engine.train_batch(_data(1, 2, 1, 0))
    mine = {k: engine.strategy.full_fp32_param(p).clone() for k, p in model.named_parameters()}
    stages: list[Any] = [None] * world
    dist.all_gather_object(stages, mine)
    saved = engine.save_16bit_model(directory, "model.safetensors")
    engine.save_checkpoint(directory, tag="t")
    engine.destroy()
    out: dict[str, Any] = {"saved": saved, "whole": {k: v for s in stages for k, v in s.items()},
                           "all_keys": sorted(model.pipeline_state_keys()), "stage": rank}
    if rank == 0:
        out["file"] = ckpt_io.load_tensors(os.path.join(directory, "model.safetensors"))
    model, engine = _engine(2, 2, zero=1, seed_layers=False)
    reads: list[str] = []
    original = ckpt_io.load_tensors

    def recording(path: Any, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        got = original(path, *args, **kwargs)
        if os.path.basename(str(path)).startswith(("zero_rank", "module_extra")) and got:
            reads.append(os.path.basename(str(path)))
        return got

    ckpt_io.load_tensors = recording
    try:
        engine.load_checkpoint(directory, tag="t")
    finally:
        ckpt_io.load_tensors = original
    out["reads"] = sorted(reads)
    out["loaded"] = {k: engine.strategy.full_fp32_param(p).clone() for k, p in model.named_parameters()}
    engine.destroy()
    return out
