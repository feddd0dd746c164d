"""Small models, data and the single-process PyTorch reference the distributed runs are compared with."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from tests.multiproc.device import rank_device

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
    device = rank_device()  # the CPU unless the suite runs with --device cuda
    return x[start:start + micro].to(device), y[start:start + micro].to(device)


def model_inputs(engine: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``inputs`` with the floating-point ones cast to the dtype the engine's model computes in
    (``engine.get_data_types()[0]``), as a DeepSpeed user casts them for a bf16 / fp16 model: the engine, like
    DeepSpeed's, passes inputs to the model unchanged. Integer tensors (labels, token ids) stay as they are."""
    dtype = engine.get_data_types()[0]
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)


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
    return train_reference(model, opt, batches, clip, scheduler(opt) if scheduler is not None else None)


def train_reference(model: nn.Module, opt: torch.optim.Optimizer, batches: list, clip: float,
                    sched: Any = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process loop every reference uses: full global batch, torch's clip_grad_norm_."""
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


VOCAB, CTX = 32, 8


class TinyTransformer(nn.Module):
    """The awkward cases for ZeRO-3: a tied embedding/head (one parameter, two modules), a block called
    twice per forward, a frozen layer, a buffer, LayerNorms and attention."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(CTX, d) * 0.02)
        self.block = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("temperature", torch.tensor(0.9))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx) + self.pos[: idx.shape[1]]
        h = self.block(h)
        h = self.block(h)  # the same module twice
        h = h + torch.tanh(self.frozen(h))
        logits = self.head(self.norm(h)) / self.temperature
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def make_transformer(seed: int = 0) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer()


def make_token_batches(steps: int, global_batch: int, seed: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (global_batch, CTX), generator=g),
             torch.randint(0, VOCAB, (global_batch, CTX), generator=g)) for _ in range(steps)]


def reference_transformer(batches: list, clip: float, lr: float = 0.1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """SGD with momentum: Adam would turn the attention key bias's exactly-zero gradient (its round-off)
    into full-size steps, making a 1e-6 comparison meaningless for that one tensor."""
    model = make_transformer()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=0.9)
    return train_reference(model, opt, batches, clip)
