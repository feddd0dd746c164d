"""The benchmark workloads: a model whose ``forward(x, y)`` returns the loss, and deterministic data.

Every engine sees the same initial weights (built under one seed, in fp32) and the same global batch
per step: the batch is generated whole from ``(seed, step)`` and each rank takes its contiguous slice,
so the global-batch loss is comparable across engines and process counts.

- ``mlp``: a stack of pre-norm residual MLP blocks (LayerNorm, Linear d->h, GELU, Linear h->d),
  regression onto a fixed function of the input (MSE). The default size is ~100M parameters.
- ``mlp12``: the same blocks, narrower and deeper (width 1024, 12 blocks, ~101M parameters) with a
  small batch (16: 8 per process on 2), where the optimizer and the gradient reduction dominate the step.
- ``gpt``: a small GPT-style decoder (token + position embeddings, pre-norm attention and MLP
  blocks, causal self-attention, untied LM head), next-token prediction on synthetic arithmetic
  sequences ``t_i = (start + stride * i) mod vocab`` (learnable, no download).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


# ------------------------------------------------------------------------------------------- models
class MLPBlock(nn.Module):
    """x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLPStack(nn.Module):
    """Residual MLP blocks; ``forward(x, y)`` returns the MSE loss (computed in fp32)."""

    def __init__(self, dim: int, hidden: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(dim, hidden) for _ in range(blocks))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(x.float(), y.float())


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads != 0:
            raise ValueError(f"gpt dim ({dim}) must be divisible by heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyGPT(nn.Module):
    """A GPT-style decoder; ``forward(tokens, targets)`` returns the mean cross-entropy (fp32)."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Workload:
    """A model factory, a batch generator and the throughput unit.

    ``global_batch`` samples per optimizer step, split evenly over the ranks; ``tokens_per_sample`` is
    1 for the MLP (throughput in samples/s) and the sequence length for the GPT (tokens/s).
    """

    name: str
    kind: str
    global_batch: int
    dims: dict[str, int] = field(default_factory=dict)
    tokens_per_sample: int = 1

    @property
    def unit(self) -> str:
        return "tokens" if self.kind == "gpt" else "samples"

    def build_model(self, seed: int) -> nn.Module:
        """The fp32 model with the weights every engine starts from."""
        torch.manual_seed(seed)
        d = self.dims
        if self.kind == "mlp":
            return MLPStack(d["dim"], d["hidden"], d["blocks"])
        return TinyGPT(d["vocab"], d["dim"], d["layers"], d["heads"], d["seq_len"])

    def block_modules(self, model: nn.Module) -> list[nn.Module]:
        """The per-block units FSDP2 shards one by one (``fully_shard`` per block)."""
        return list(model.blocks)  # type: ignore[attr-defined]

    def batch(self, seed: int, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the global batch of ``step`` (identical for every engine)."""
        if self.global_batch % world_size != 0:
            raise ValueError(f"global batch ({self.global_batch}) must be divisible by the process count "
                             f"({world_size}); pick --nprocs that divides it")
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        x, y = _MAKERS[self.kind](self, gen)
        per_rank = self.global_batch // world_size
        lo, hi = rank * per_rank, (rank + 1) * per_rank
        return x[lo:hi].contiguous(), y[lo:hi].contiguous()

    def samples_per_step(self) -> int:
        return self.global_batch * self.tokens_per_sample

    def parameter_count(self) -> int:
        """Ψ without building the model (closed form, checked against the module in the tests)."""
        d = self.dims
        if self.kind == "mlp":
            per_block = 2 * d["dim"] * d["hidden"] + d["hidden"] + d["dim"] + 2 * d["dim"]
            return d["blocks"] * per_block
        dim, vocab = d["dim"], d["vocab"]
        per_block = 4 * dim + (3 * dim * dim + 3 * dim) + (dim * dim + dim) + (8 * dim * dim + 5 * dim)
        return vocab * dim * 2 + d["seq_len"] * dim + d["layers"] * per_block + 2 * dim


def _mlp_batch(w: Workload, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(w.global_batch, w.dims["dim"], generator=gen)
    y = 0.5 * x.roll(1, dims=-1) - 0.25 * x  # a fixed linear target, no extra weight tensor
    return x, y


def _gpt_batch(w: Workload, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    vocab, seq = w.dims["vocab"], w.dims["seq_len"]
    start = torch.randint(0, vocab, (w.global_batch, 1), generator=gen)
    stride = torch.randint(1, 8, (w.global_batch, 1), generator=gen)
    seqs = (start + stride * torch.arange(seq + 1)) % vocab
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


_MAKERS: dict[str, Callable[[Workload, torch.Generator], tuple[torch.Tensor, torch.Tensor]]] = {
    "mlp": _mlp_batch, "gpt": _gpt_batch}


def make_workload(name: str, quick: bool = False, global_batch: int | None = None) -> Workload:
    """``mlp`` (~100M parameters; ``quick``: ~4M), ``mlp12`` (~101M: width 1024, 12 blocks, global batch 16,
    i.e. micro batch 8 on 2 processes; ``quick``: ~6M) or ``gpt`` (~11M; ``quick``: ~0.9M)."""
    if name == "mlp":
        dims = {"dim": 512, "hidden": 1024, "blocks": 4} if quick else {"dim": 2048, "hidden": 4096, "blocks": 6}
        return Workload("mlp", "mlp", global_batch or 64, dims)
    if name == "mlp12":  # deeper and narrower, 8 samples per process: the optimizer and the reduction weigh more
        dims = {"dim": 256, "hidden": 1024, "blocks": 12} if quick else {"dim": 1024, "hidden": 4096, "blocks": 12}
        return Workload("mlp12", "mlp", global_batch or 16, dims)
    if name == "gpt":
        dims = ({"vocab": 256, "dim": 128, "layers": 4, "heads": 4, "seq_len": 64} if quick else
                {"vocab": 512, "dim": 384, "layers": 6, "heads": 6, "seq_len": 128})
        return Workload("gpt", "gpt", global_batch or 16, dims, tokens_per_sample=dims["seq_len"])
    if name == "tiny":  # ~10k parameters: the harness smoke test
        return Workload("tiny", "mlp", global_batch or 8, {"dim": 32, "hidden": 64, "blocks": 2})
    raise ValueError(f"unknown workload {name!r}; choose one of: mlp, mlp12, gpt, tiny")


WORKLOADS: tuple[str, ...] = ("mlp", "mlp12", "gpt")


def describe(w: Workload) -> str:
    """One line: name, parameters, batch."""
    dims = ", ".join(f"{k}={v}" for k, v in w.dims.items())
    psi = w.parameter_count()
    size = f"{psi / 1e6:.1f}M" if psi >= 1e5 else f"{psi / 1e3:.1f}k"
    extra = f" x {w.tokens_per_sample} tokens" if w.tokens_per_sample > 1 else ""
    return f"{w.name}: {size} parameters ({dims}), global batch {w.global_batch}{extra}"

