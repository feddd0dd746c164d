"""A small GPT written twice: with plain torch layers (the reference) and with deepshard's Megatron layers.

Both build their modules in the same order with the same shapes, so under the same seed the TP model's
parameters are exactly slices of the plain model's (the layers initialize the full layer, then slice).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepshard.comm.group import CommGroup
from deepshard.tp import (ColumnParallelLinear, RowParallelLinear, SequenceParallel, VocabParallelEmbedding,
                          parallel_lm_logits, vocab_parallel_cross_entropy)


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 32
    hidden: int = 16
    heads: int = 4
    layers: int = 2
    ffn: int = 32
    seq: int = 8


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    b, s, _ = q.shape
    q, k, v = (t.view(b, s, -1, head_dim).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, s, -1)


class PlainBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        h = cfg.hidden
        self.head_dim = h // cfg.heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.o = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        q, k, v = self.qkv(y).chunk(3, dim=-1)
        x = x + self.o(_attention(q, k, v, self.head_dim))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PlainGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(PlainBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.embed.weight)  # tied head
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class TPBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, group: CommGroup, sp: bool) -> None:
        super().__init__()
        h = cfg.hidden
        self.head_dim = h // cfg.heads
        self.ln1 = _norm(h, group, sp)
        self.qkv = ColumnParallelLinear(h, 3 * h, group, sequence_parallel=sp, parts=(h, h, h))
        self.o = RowParallelLinear(h, h, group, sequence_parallel=sp)
        self.ln2 = _norm(h, group, sp)
        self.fc1 = ColumnParallelLinear(h, cfg.ffn, group, sequence_parallel=sp)
        self.fc2 = RowParallelLinear(cfg.ffn, h, group, sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        q, k, v = self.qkv(y).chunk(3, dim=-1)
        x = x + self.o(_attention(q, k, v, self.head_dim))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _norm(h: int, group: CommGroup, sp: bool) -> nn.Module:
    return SequenceParallel(nn.LayerNorm(h), group) if sp else nn.LayerNorm(h)


class TPGPT(nn.Module):
    """The same GPT with the Megatron layers; ``sp``: sequence parallelism between the regions."""

    def __init__(self, cfg: GPTConfig, group: CommGroup, sp: bool = False) -> None:
        super().__init__()
        self.group, self.sp = group, sp
        self.embed = VocabParallelEmbedding(cfg.vocab, cfg.hidden, group, sequence_parallel=sp)
        self.blocks = nn.ModuleList(TPBlock(cfg, group, sp) for _ in range(cfg.layers))
        self.ln_f = _norm(cfg.hidden, group, sp)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = parallel_lm_logits(self.ln_f(x), self.embed.weight, self.group, sequence_parallel=self.sp)
        return vocab_parallel_cross_entropy(logits, labels, self.group)


def plain_name(tp_name: str) -> str:
    """The plain model's name for a TP model's parameter (``SequenceParallel`` adds ``.module``)."""
    return tp_name.replace(".module.", ".")


def make_tokens(cfg: GPTConfig, batch: int, steps: int, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


# ----------------------------------------------------------------------- a hand-written LLaMA-style model
@dataclass
class LlamaLikeConfig:
    """Carries the Hugging Face attribute names automatic TP reads."""

    vocab_size: int = 32
    hidden_size: int = 16
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 24
    num_hidden_layers: int = 2


class RMSNorm(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaLikeConfig) -> None:
        super().__init__()
        h, self.head_dim = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
        kv = cfg.num_key_value_heads * self.head_dim
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.q_proj, self.k_proj = nn.Linear(h, h, bias=False), nn.Linear(h, kv, bias=False)
        self.v_proj, self.o_proj = nn.Linear(h, kv, bias=False), nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # local heads: -1
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2).repeat_interleave(self.groups, 1)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2).repeat_interleave(self.groups, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaLikeConfig) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, cfg: LlamaLikeConfig) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(cfg.hidden_size), LlamaAttention(cfg)
        self.post_attention_layernorm, self.mlp = RMSNorm(cfg.hidden_size), LlamaMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaLike(nn.Module):
    """Unmodified user code: automatic TP must shard it as it is."""

    def __init__(self, cfg: LlamaLikeConfig | None = None) -> None:
        super().__init__()
        self.config = cfg or LlamaLikeConfig()
        c = self.config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
