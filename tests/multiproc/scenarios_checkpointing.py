"""What each rank runs for the ZeRO-3 + activation checkpointing tests: a model whose blocks are
recomputed in backward (non-reentrant with and without early stop, reentrant, none), trained at
stage 3, with the gathers and the gathered bytes counted around every step."""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import deepshard
from deepshard.zero.stage3.group import GroupState, ShardedGroup
from tests.multiproc.device import rank_device
from tests.multiproc.models import micro_slice
from tests.multiproc.scenarios_stage0 import full_weights

D_IN, D, CLASSES = 8, 16, 4
STEPS, GLOBAL_BATCH, LR, CLIP = 3, 8, 0.1, 0.5
PERSISTENCE = 100  # elements: the LayerNorms (32) and the head (68) stay gathered, nothing else
# (mode, micro batch, accumulation steps) for a world of 2: each mode once, non-reentrant also accumulated
RUNS = [("none", 4, 1), ("nonreentrant", 4, 1), ("nonreentrant", 2, 2), ("nonreentrant-full", 4, 1),
        ("reentrant", 4, 1)]


class CkptNet(nn.Module):
    """An input layer, two blocks (the first with a frozen layer inside) and a head; ``mode`` says how
    the blocks are checkpointed: ``none``, ``nonreentrant`` (PyTorch's default early stop),
    ``nonreentrant-full`` (early stop off: every recomputed forward returns) or ``reentrant``."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.GELU(),
                                                  nn.Linear(4 * D, D)) for _ in range(2))
        self.blocks[0].append(nn.Linear(D, D).requires_grad_(False))
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            if self.mode == "none":
                h = h + block(h)
            else:
                h = h + checkpoint(block, h, use_reentrant=self.mode == "reentrant")
        return F.cross_entropy(self.head(h), y)


def make_ckpt_net(mode: str) -> CkptNet:
    torch.manual_seed(0)
    return CkptNet(mode)


def make_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(GLOBAL_BATCH, D_IN, generator=g), torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g))
            for _ in range(STEPS)]


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process PyTorch, no checkpointing, the full global batch per step, torch's clip_grad_norm_
    and SGD with momentum."""
    model = make_ckpt_net("none")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    losses = []
    for x, y in make_data():
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


class GatherMeter:
    """Counts the gathers of non-persistent groups and the peak of their gathered bytes."""

    def __init__(self, groups: list[ShardedGroup]) -> None:
        self.groups = [g for g in groups if not g.persistent]
        self.gathers, self.peak, self.on = 0, 0, False
        for g in self.groups:
            g.unshard = self._wrap(g, g.unshard)  # type: ignore[method-assign]

    def _wrap(self, group: ShardedGroup, unshard: Any) -> Any:
        def counted(async_op: bool = True) -> None:
            if self.on and group.state is GroupState.SHARDED:
                self.gathers += 1
            unshard(async_op)
            if self.on:
                self.peak = max(self.peak, sum(g.live_bytes() for g in self.groups))
        return counted


def train_mode(rank: int, world: int, mode: str, micro: int, gas: int) -> dict[str, Any]:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}}, "gradient_clipping": CLIP,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": PERSISTENCE}}
    engine, *_ = deepshard.initialize(model=make_ckpt_net(mode), config=cfg)
    strategy = engine.strategy
    all_groups = strategy.groups + strategy.frozen_groups
    persistent_bytes = sum(g.padded * g.full.element_size() for g in all_groups if g.persistent)
    meter = GatherMeter(all_groups)
    losses, gathered, gathers, peaks = [], [], [], []
    early_stop = set_checkpoint_early_stop(False) if mode == "nonreentrant-full" else contextlib.nullcontext()
    with early_stop:
        for batch in make_data():
            total = torch.zeros(1, device=rank_device())  # the CPU unless the suite runs with --device cuda
            meter.gathers = meter.peak = 0
            for k in range(gas):
                x, y = micro_slice(batch, micro, k, rank, world)
                meter.on = True
                loss = engine(x, y)
                engine.backward(loss)
                meter.on = False
                engine.step()
                total += loss.detach()
            torch.distributed.all_reduce(total)
            losses.append(float(total) / (gas * world))
            gathered.append(engine.memory_report()["gathered_parameters"])
            gathers.append(meter.gathers)
            peaks.append(meter.peak)
    weights = full_weights(engine)
    out = {"losses": losses, "weights": weights, "gathered_after_step": gathered, "gathers": gathers,
           "peak_gathered": peaks, "persistent_bytes": persistent_bytes,
           "all_bytes": sum(g.padded * g.full.element_size() for g in all_groups),
           "users": [g.users for g in all_groups], "recomputed": sum(not g.persistent for g in all_groups
                                                                     if g.module_name.startswith("blocks."))}
    engine.destroy()
    return out


def checkpointing_world(rank: int, world: int) -> dict[str, Any]:
    return {f"{mode}_m{micro}_g{gas}": train_mode(rank, world, mode, micro, gas) for mode, micro, gas in RUNS}
