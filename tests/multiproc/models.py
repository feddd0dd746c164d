"""Small models, data and the single-process PyTorch reference the distributed runs are compared with."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

IN_FEATURES, CLASSES = 8, 4


class TinyNet(nn.Module):
    """Has what the oracle must cover: a frozen layer, a buffer, LayerNorm, several buckets' worth of
    parameters and a parameter count not divisible by 2, 3 or 4."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(IN_FEATURES, d)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.block = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, CLASSES)
        self.odd = nn.Parameter(torch.randn(7) * 0.1)
        self.register_buffer("scale", torch.tensor(1.5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + torch.tanh(self.frozen(h))
        h = h + self.block(h)
        logits = self.head(h * self.scale) + self.odd[:CLASSES]
        return F.cross_entropy(logits.float(), y)


def make_model(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def make_batches(steps: int, global_batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, IN_FEATURES, generator=g),
             torch.randint(0, CLASSES, (global_batch,), generator=g)) for _ in range(steps)]


def micro_slice(batch: tuple[torch.Tensor, torch.Tensor], micro: int, micro_step: int, rank: int,
                world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples rank ``rank`` uses at accumulation step ``micro_step``."""
    start = (micro_step * world + rank) * micro
    x, y = batch
    return x[start:start + micro], y[start:start + micro]


def optimizer_config(lr: float = 1e-2) -> dict[str, Any]:
    return {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}}


def sgd_config(lr: float = 0.05) -> dict[str, Any]:
    """Plain SGD is sensitive to the gradient's magnitude (Adam and clipping are not): it catches a
    wrong averaging factor."""
    return {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}}


def reference_run(batches: list[tuple[torch.Tensor, torch.Tensor]], clip: float, lr: float = 1e-2,
                  scheduler: Callable[[torch.optim.Optimizer], Any] | None = None, sgd: bool = False
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process PyTorch: the full global batch per step, AdamW (or SGD), torch's
    clip_grad_norm_."""
    model = make_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    if sgd:
        opt: torch.optim.Optimizer = torch.optim.SGD(trainable, lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    sched = scheduler(opt) if scheduler is not None else None
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||b||, tiny): a relative error that is meaningful for whole tensors."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / max(float(b.norm()), 1e-12))
