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


def full_fp32(engine: Any, param: torch.nn.Parameter) -> torch.Tensor:
    """What ``deepshard.utils.safe_get_full_fp32_param(param)`` returns: the owning strategy's
    ``full_fp32_param``. Called on the strategy directly because the public helper's lookup
    (``zero.strategy.PARAM_OWNERS``, a ``weakref.WeakKeyDictionary``) raises "Boolean value of Tensor
    with more than one value is ambiguous" for any parameter with more than one element;
    ``test_zero_to_fp32.py::test_public_fp32_helper_agrees`` (strict xfail) flags when it is fixed,
    and then this body becomes ``return safe_get_full_fp32_param(param)``."""
    return engine.strategy.full_fp32_param(param)


def reported_state(engine: Any) -> dict[str, dict[str, torch.Tensor]]:
    """What the running engine says the checkpoint must hold: fp32 masters, the 16-bit module values,
    buffers and frozen parameters."""
    module = engine.module
    params = dict(module.named_parameters())
    return {
        "fp32": {n: full_fp32(engine, p) for n, p in params.items() if p.requires_grad},
        "module": {n: p.detach().clone() for n, p in params.items()},
        "frozen": {n: p.detach().clone() for n, p in params.items() if not p.requires_grad},
        "buffers": {n: b.detach().clone() for n, b in module.named_buffers()},
    }


def consolidate_world(rank: int, world: int, save_dir: str, stage: int) -> dict[str, Any]:
    """Train 2 steps on per-rank data, save a checkpoint, report the state the checkpoint must hold."""
    engine = make_engine(stage)
    train_steps(engine, 2, seed=rank)
    engine.save_checkpoint(save_dir)
    out = reported_state(engine)
    out["dp_world_size"] = engine.dp_world_size
    return out
