"""What each rank runs for the zero_to_fp32 tests, and the model they share with the unit tests."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import deepshard

VOCAB, DIM = 11, 6


class TiedNet(nn.Module):
    """Covers every kind of state_dict entry: a tied weight (embedding = output head), a frozen layer, a
    float buffer, an integer buffer and a parameter whose size no world size divides."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.odd = nn.Parameter(torch.randn(7) * 0.1)
        self.register_buffer("scale", torch.tensor(1.25))
        self.register_buffer("seen", torch.tensor(3, dtype=torch.int64))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + torch.tanh(self.frozen(h))
        h = h + self.mix(self.norm(h)) * self.scale
        logits = self.head(h) + self.odd.sum()
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def make_engine(stage: int, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-2, "weight_decay": 0.01}},
              "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}
    engine, _, _, _ = deepshard.initialize(model=TiedNet(), config=config)
    return engine


def train_steps(engine: Any, steps: int, seed: int) -> None:
    """``steps`` optimizer steps on data that differs per ``seed`` (pass the rank to vary it per rank)."""
    g = torch.Generator().manual_seed(1000 + seed)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (2, 5), generator=g)
        y = torch.randint(0, VOCAB, (2, 5), generator=g)
        engine.backward(engine(x, y))
        engine.step()


def reported_state(engine: Any) -> dict[str, dict[str, torch.Tensor]]:
    """What the running engine says the checkpoint must hold: fp32 masters, the 16-bit module values,
    buffers and frozen parameters."""
    from deepshard.utils import safe_get_full_fp32_param

    module = engine.module
    params = dict(module.named_parameters())
    return {
        "fp32": {n: safe_get_full_fp32_param(p) for n, p in params.items() if p.requires_grad},
        "module": {n: p.detach().clone() for n, p in params.items()},
        "frozen": {n: p.detach().clone() for n, p in params.items() if not p.requires_grad},
        "buffers": {n: b.detach().clone() for n, b in module.named_buffers()},
    }


def consolidate_world(rank: int, world: int, save_root: str, stages: tuple[int, ...]) -> dict[int, Any]:
    """Per ZeRO stage: train 2 steps on per-rank data, save to ``save_root/stage<N>``, report the state
    the checkpoint must hold (one world for all stages: spawning one costs more than the training)."""
    out: dict[int, Any] = {}
    for stage in stages:
        engine = make_engine(stage)
        train_steps(engine, 2, seed=rank)
        engine.save_checkpoint(f"{save_root}/stage{stage}")
        out[stage] = reported_state(engine)
        out[stage]["dp_world_size"] = engine.dp_world_size
        out[stage]["zero_stage"] = engine.zero_optimization_stage()
    return out
