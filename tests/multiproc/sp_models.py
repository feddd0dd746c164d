"""A tiny causal language model whose attention runs sequence-parallel when given a ``SequenceParallel``
(RoPE from global position ids, grouped-query attention), and its single-process reference loop."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, HEADS, KV_HEADS, LAYERS = 32, 24, 6, 2, 2


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [b, h, s, d] at global positions [b, s]."""
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = positions.float().unsqueeze(-1) * inv  # [b, s, d/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1).unsqueeze(1), torch.cat([angles.sin()] * 2, -1).unsqueeze(1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], -1) * sin.to(x.dtype)


class Block(nn.Module):
    def __init__(self, owner: "TinyLM") -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.num_heads, self.num_key_value_heads = HEADS, KV_HEADS  # automatic TP divides them by tp
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q = nn.Linear(DIM, DIM)
        self.kv = nn.Linear(DIM, 2 * KV_HEADS * self.head_dim)
        self.o = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self._owner = [owner]  # not a submodule

    def forward(self, x: torch.Tensor, positions: torch.Tensor, seq_len: int) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, -1, self.head_dim).transpose(1, 2)  # this rank's heads (all of them without TP)
        k, v = self.kv(h).view(b, s, 2, -1, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rope(q, positions), rope(k, positions)
        sp = self._owner[0].sp
        if sp is None:
            groups = HEADS // KV_HEADS
            att = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                                 is_causal=True)
        else:
            att = sp.attention(q, k, v, seq_len)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(self) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.sp: Any = None
        self.activation_checkpointing = activation_checkpointing

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
        x = self.emb(input_ids)
        for block in self.blocks:
            if self.activation_checkpointing:
                x = checkpoint(block, x, position_ids, seq_len, use_reentrant=False)
            else:
                x = block(x, position_ids, seq_len)
        return self.lm_head(self.norm(x))


def make_lm(seed: int = 0, activation_checkpointing: bool = False) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(activation_checkpointing)


def make_samples(count: int, seq_len: int, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (count, seq_len), generator=g)


def sample_loss(model: TinyLM, ids: torch.Tensor) -> torch.Tensor:
    """One process: the token-mean next-token loss of one sample [1, s]."""
    s = ids.shape[1]
    logits = model(ids, torch.arange(s).unsqueeze(0), s)
    return F.cross_entropy(logits[0, :-1].float(), ids[0, 1:])


def reference_lm(samples: torch.Tensor, steps: int, per_step: int, clip: float, lr: float = 1e-2,
                 model: Optional[TinyLM] = None, norms: Optional[list[float]] = None
                 ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """AdamW on the mean of ``per_step`` samples' token-mean losses per step (samples taken in order);
    ``norms`` collects each step's gradient norm before clipping."""
    model = model if model is not None else make_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for step in range(steps):
        batch = samples[step * per_step:(step + 1) * per_step]
        loss = sum(sample_loss(model, batch[i:i + 1]) for i in range(per_step)) / per_step
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if norms is not None:
            norms.append(float(norm))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
