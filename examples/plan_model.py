"""A model file for `deepshard plan` (see deepshard.dryrun.plan_model): a small GPT over bytes.

    deepshard plan examples/plan_model.py --config examples/plan_config.json --world_size 8 --memory-per-rank 40MiB
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB, BLOCK, WIDTH, HEADS, LAYERS = 256, 64, 128, 4, 4


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(BLOCK, WIDTH)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class Block(nn.Module):
    """Pre-LayerNorm causal self-attention and a GELU MLP (q/k/v and the MLP split for tensor parallelism)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.o_proj = nn.Linear(WIDTH, WIDTH)
        self.up_proj, self.down_proj = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(b, t, -1, WIDTH // HEADS).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.o_proj(att)
        return x + self.down_proj(F.gelu(self.up_proj(self.ln2(x))))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.lm_head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln(x))


class GPT(nn.Module):
    def __init__(self, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.embed, self.head = Embed(), Head()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.activation_checkpointing = activation_checkpointing

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.activation_checkpointing and self.training else block(x)
        return pipeline_loss(self.head(x), labels)


def build_model(activation_checkpointing: bool = False) -> nn.Module:
    return GPT(activation_checkpointing)


def sample_batch(micro_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (micro_batch_size, BLOCK + 1))
    return ids[:, :-1], ids[:, 1:]


def pipeline_layers() -> list:
    from deepshard.pipe import LayerSpec

    return [LayerSpec(Embed)] + [LayerSpec(Block) for _ in range(LAYERS)] + [LayerSpec(Head)]


def pipeline_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


pipeline_batch = sample_batch
