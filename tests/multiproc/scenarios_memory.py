"""Measured peak tensor memory of real runs, and the estimate for the same run (importable by ranks)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import deepshard
from deepshard.config import load_config
from deepshard.profiling.memory_estimator import estimate_run_memory
from deepshard.profiling.memory_tracker import TensorMemoryTracker
from tests.multiproc.models import model_inputs

MICRO, D_IN, CLASSES = 32, 32, 10


class MemNet(nn.Module):
    """Residual MLP blocks, optionally each under activation checkpointing."""

    def __init__(self, ckpt: bool, d: int = 96, layers: int = 3) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.inp = nn.Linear(D_IN, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                                  nn.Linear(4 * d, d)) for _ in range(layers))
        self.out = nn.Linear(d, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + (checkpoint(block, h, use_reentrant=False) if self.ckpt else block(h))
        return F.cross_entropy(self.out(h).float(), y)


def memory_config(stage: int, bf16: bool) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": bf16},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 20000, "allgather_bucket_size": 20000,
                                  "stage3_param_persistence_threshold": 1000}}


def measure_one(rank: int, world: int, stage: int, bf16: bool, ckpt: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = memory_config(stage, bf16)
    engine, *_ = deepshard.initialize(model=MemNet(ckpt), config=cfg)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(MICRO, D_IN, generator=g), torch.randint(0, CLASSES, (MICRO,), generator=g)
    for _ in range(1):  # optimizer state exists from the first step on
        engine.backward(engine(*model_inputs(engine, x, y)))
        engine.step()
    report = engine.memory_report()
    with TensorMemoryTracker("cpu") as tracker:
        engine.backward(engine(*model_inputs(engine, x, y)))
        engine.step()
    engine.destroy()
    estimate = estimate_run_memory(MemNet(ckpt), load_config(cfg, dp_world_size=world), (x, y), world)
    return {"peak": tracker.peak_bytes, "start": tracker.start_bytes, "report": report,
            "estimate": estimate.peak, "states": estimate.states, "persistent": estimate.persistent}


# (stage, bf16, activation checkpointing): of the 12 combinations of a stage with fp32, fp32 +
# checkpointing or bf16, all but stage 1 with checkpointing and stage 2 in fp32 without, for time (bf16's
# peak is the optimizer step's fp32 gradient copy, with or without checkpointing)
CASES = [(0, False, False), (0, False, True), (0, True, False), (1, False, False), (1, True, False),
         (2, False, True), (2, True, False), (3, False, False), (3, False, True), (3, True, False)]


def measure_all(rank: int, world: int) -> dict[tuple[int, bool, bool], dict[str, Any]]:
    return {case: measure_one(rank, world, *case) for case in CASES}
