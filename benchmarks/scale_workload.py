"""The workload of ``benchmarks/scale.py``: one rank of a tiny GPT, trained a few steps, saved and loaded.

Two layouts of the same layers: ``dp`` (ZeRO-2, every rank a data-parallel replica of the whole model)
and ``pp2`` (a 2-stage pipeline, ZeRO-1 over the rest: pp=2 x dp=N/2). The same function runs in a real
gloo world (each of N processes) and in a dry run (one rank over the fake process group); what it
measures itself (save time, what ``load_checkpoint`` reads) goes into ``figures``.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, BLOCK, WIDTH, HEADS, LAYERS, MICRO, STEPS = 256, 32, 64, 4, 4, 4, 3


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(BLOCK, WIDTH)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class Block(nn.Module):
    """Pre-LayerNorm causal self-attention and a GELU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = (z.view(b, t, HEADS, w // HEADS).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(w, dim=2))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, w)
        x = x + self.proj(att)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.lm = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def parameters() -> int:
    """The model's parameter count (the same in both layouts)."""
    return sum(p.numel() for m in (Embed(), *[Block() for _ in range(LAYERS)], Head()) for p in m.parameters())


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (rows, BLOCK + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _build(layout: str) -> tuple[Any, dict[str, Any]]:
    import deepshard
    from deepshard.pipe import LayerSpec, PipelineModule

    torch.manual_seed(0)
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0,
                              "zero_optimization": {"stage": 2}}
    if layout == "pp2":
        model: nn.Module = PipelineModule([LayerSpec(Embed)] + [LayerSpec(Block) for _ in range(LAYERS)]
                                          + [LayerSpec(Head)], num_stages=2, loss_fn=lm_loss)
        config.update({"gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}})
    elif layout == "dp":
        model = nn.Sequential(Embed(), *[Block() for _ in range(LAYERS)], Head())
    else:
        raise ValueError(f"layout {layout!r}: use dp or pp2")
    engine, *_ = deepshard.initialize(model=model, config=config)
    return engine, config


def _train(engine: Any, layout: str, step: int) -> None:
    dims, coord = engine.topology.dims, engine.topology.coord
    gas = engine.gradient_accumulation_steps()
    x, y = _batch(step, MICRO * gas * dims.dp)
    rows = [slice((k * dims.dp + coord.dp) * MICRO, (k * dims.dp + coord.dp + 1) * MICRO) for k in range(gas)]
    if layout == "pp2":
        engine.train_batch(iter([(x[r], y[r]) for r in rows]))
        return
    for r in rows:
        engine.backward(lm_loss(engine(x[r]), y[r]))
        engine.step()


def body(layout: str, save_dir: str, figures: dict[str, Any]) -> Callable[[], None]:
    """A training script as a function (see the module docstring)."""
    from deepshard.checkpoint.ledger import track_io

    def run() -> None:
        engine, _ = _build(layout)
        for step in range(STEPS):
            _train(engine, layout, step)
        start = time.perf_counter()
        engine.save_checkpoint(save_dir, tag="scale")
        figures["save_s"] = time.perf_counter() - start
        start = time.perf_counter()
        with track_io() as io:
            path, _ = engine.load_checkpoint(save_dir, tag="scale")
        figures["load_s"] = time.perf_counter() - start if path is not None else math.nan
        figures["load_files"], figures["load_bytes"] = io.files_read, io.bytes_read
        figures["loaded"] = path is not None
        engine.destroy()

    return run
