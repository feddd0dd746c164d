"""Sequence-parallel attention: Ulysses (all-to-all over heads), ring, or both (hybrid).

``sp_attention`` takes this rank's queries, keys and values (Hugging Face layout [batch, heads, tokens,
head_dim], RoPE already applied) for the tokens ``SeqLayout.positions(sp_rank)`` says it holds, and returns
the attention output for the same tokens and heads. The steps:

1. heads made divisible by the Ulysses group (``heads.head_plan``);
2. all-to-all over the Ulysses group: each rank now holds its ring shard's every token for 1/u of the heads;
3. attention over the ring group (``ring.ring_attention``; a ring of one rank is plain attention computed
   block-wise, with its backward recomputed from the saved log-sum-exp);
4. all-to-all back, padding heads dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from deepshard.comm.group import CommGroup
from deepshard.sp.collectives import all_to_all
from deepshard.sp.heads import head_plan
from deepshard.sp.layout import SeqLayout
from deepshard.sp.ring import ring_attention


@dataclass(frozen=True)
class SPGroups:
    """The sequence-parallel group and its two sub-groups (``sp = ring x ulysses``)."""

    sp: CommGroup
    ulysses: CommGroup
    ring: CommGroup

    @property
    def sp_rank(self) -> int:
        return self.ring.rank * self.ulysses.size + self.ulysses.rank

    def layout(self, seq_len: int, balance: bool = True) -> SeqLayout:
        return SeqLayout(seq_len=seq_len, ring=self.ring.size, ulysses=self.ulysses.size, balance=balance)


def sp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: SPGroups, layout: SeqLayout,
                 causal: bool = True, scale: Optional[float] = None, segments: Optional[torch.Tensor] = None
                 ) -> torch.Tensor:
    """This rank's attention output [b, h, s_local, d] (see the module text). ``segments``: [b, padded
    length] segment ids by global position (packed documents, padding -1; ``softmax_merge.segment_ids``)."""
    if layout.ring != groups.ring.size or layout.ulysses != groups.ulysses.size:
        raise ValueError(f"the layout is ring {layout.ring} x ulysses {layout.ulysses} but the groups are "
                         f"{groups.ring.size} x {groups.ulysses.size}")
    if q.shape[2] != layout.local_len:
        raise ValueError(f"this rank holds {q.shape[2]} tokens but the layout gives it {layout.local_len} "
                         f"(a sequence of {layout.seq_len} padded to {layout.padded_len}); shard the batch with "
                         "the same layout")
    heads = q.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    u = groups.ulysses
    q, k, v = head_plan(heads, k.shape[1], u.size).apply(q, k, v)
    q, k, v = (all_to_all(t, u, scatter_dim=1, gather_dim=2) for t in (q, k, v))
    positions = [layout.shard_positions(j) for j in range(layout.ring)]
    if segments is not None and segments.shape[-1] != layout.padded_len:
        raise ValueError(f"segments cover {segments.shape[-1]} positions; the layout's padded length is "
                         f"{layout.padded_len} (pad them with -1)")
    out = ring_attention(q, k, v, groups.ring, positions, causal=causal, seq_len=layout.seq_len, scale=scale,
                         segments=segments)
    out = all_to_all(out, u, scatter_dim=2, gather_dim=1)
    return out[:, :heads]
