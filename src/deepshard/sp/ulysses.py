"""DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention``: Ulysses around your own attention.

    attn = DistributedAttention(local_attention, sequence_process_group, scatter_idx=2, gather_idx=0)
    out = attn(query, key, value, batch_dim_idx)       # [s/p, b, h, d] in, [s/p, b, h, d] out

Inputs hold this rank's contiguous slice of the sequence (``gather_idx`` is the sequence dimension) and
every head (``scatter_idx``). After the all-to-all, ``local_attention(q, k, v, *args, **kwargs)`` sees the
whole sequence for ``h / p`` heads (same layout otherwise); its output goes back the other way. Head counts
that do not divide by ``p`` and key/value heads fewer than ``p`` work (``heads.head_plan``: repeated or
zero-padded heads; the local attention then sees as many key/value heads as query heads).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from deepshard.sp.collectives import all_to_all, as_comm
from deepshard.sp.heads import head_plan


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class DistributedAttention(torch.nn.Module):
    """Ulysses sequence parallelism around ``local_attention`` (DeepSpeed's signature)."""

    def __init__(self, local_attention: torch.nn.Module, sequence_process_group: Any, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream: Any = None, num_kv_heads: Optional[int] = None) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.comm = as_comm(sequence_process_group)
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream  # accepted; the exchanges run on the current stream
        self.num_kv_heads = num_kv_heads

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int,
                rotary_pos_emb: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
        heads = query.shape[self.scatter_idx]
        kv_heads = self.num_kv_heads if self.num_kv_heads is not None else key.shape[self.scatter_idx]
        if key.shape[self.scatter_idx] != kv_heads:
            raise ValueError(f"DistributedAttention: num_kv_heads={kv_heads} but the key has "
                             f"{key.shape[self.scatter_idx]} heads along dimension {self.scatter_idx}")
        plan = head_plan(heads, kv_heads, self.comm.size)
        q, k, v = plan.apply(query, key, value, dim=self.scatter_idx)
        q, k, v = (all_to_all(t, self.comm, self.scatter_idx, self.gather_idx) for t in (q, k, v))
        if rotary_pos_emb is not None:
            cos, sin = (t.permute(1, 0, 2, 3) for t in rotary_pos_emb)  # [b, s, 1, d] -> [s, b, 1, d]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        context = self.local_attn(q, k, v, *args, **kwargs)
        out = all_to_all(context, self.comm, self.gather_idx, self.scatter_idx)
        return out.narrow(self.scatter_idx, 0, heads) if plan.pad else out
