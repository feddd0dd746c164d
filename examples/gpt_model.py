"""A small decoder-only transformer (GPT-style) over bytes, written from scratch for the demo.

Byte vocabulary (256 symbols), learned positional embeddings, pre-LayerNorm blocks with causal
self-attention (``torch.nn.functional.scaled_dot_product_attention``) and a GELU MLP, and an LM head
whose weight is tied to the token embedding. With the defaults it has about 3.3 million parameters.

``GPT(config)(idx)`` returns logits of shape ``(batch, time, vocab)``; ``GPT(config)(idx, targets)``
returns the mean next-byte cross-entropy loss, the form a DeepSpeed-style training loop wants.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model."""

    vocab_size: int = 256
    """Number of token ids; 256 for raw bytes."""
    block_size: int = 128
    """Context length: the longest sequence the positional embedding covers."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; ``d_model`` must be divisible by it."""
    d_model: int = 256
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout on attention weights and residual branches (0 keeps runs deterministic)."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head}); "
                f"pick n_head among the divisors of {self.d_model}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only sees positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.dropout = config.dropout
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        heads = (batch, time, self.n_head, width // self.n_head)
        q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, time, width)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: width -> 4 * width -> width with a GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.proj = nn.Linear(4 * config.d_model, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The language model: embeddings, ``n_layer`` blocks, a final LayerNorm and a tied LM head."""

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config or GPTConfig()
        cfg = self.config
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying: one matrix, two uses
        self.apply(self._init_weights)
        # GPT-2's scaled init: the projections that add into the residual stream get std / sqrt(2L).
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Distinct trainable parameters (the tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` for byte ids ``idx`` ``(B, T)``; with ``targets`` ``(B, T)``, the
        mean cross-entropy of predicting ``targets`` instead (a scalar, computed in fp32)."""
        time = idx.shape[1]
        if time > self.config.block_size:
            raise ValueError(
                f"sequence length {time} exceeds block_size {self.config.block_size}; "
                "cut the input or build the model with a larger GPTConfig(block_size=...)")
        pos = torch.arange(time, device=idx.device)
        x = self.drop(self.tok_emb(idx.long()) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.long().view(-1))
