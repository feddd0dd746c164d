"""Ring attention (context parallelism): each rank keeps its queries; key/value blocks travel around the
ring, one hop per step, and each rank merges the block it holds into its result with the online softmax
(``softmax_merge``). After ``ring - 1`` hops every rank has seen every block; a block that the causal mask
hides entirely is skipped (with head-tail chunks, ``layout.SeqLayout``, every rank skips as much).

The backward runs the ring again: the key/value gradient of a block travels with the block, each rank
adds its share, and one last hop brings it home. Only this rank's blocks and one visiting block are held
at a time, in both directions.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from deepshard.comm.group import CommGroup
from deepshard.sp.collectives import RingPass
from deepshard.sp.softmax_merge import allowed_mask, block_backward, block_forward, merge


def _pack(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: CommGroup,
                positions: Sequence[torch.Tensor], causal: bool, seq_len: int, scale: float,
                segments: Optional[torch.Tensor]) -> torch.Tensor:
        n, me = comm.size, comm.rank
        ring = RingPass(comm) if n > 1 else None
        kv = _pack(k, v)
        out: Optional[torch.Tensor] = None
        lse: Optional[torch.Tensor] = None
        for step in range(n):
            if ring is not None and step < n - 1:
                ring.start(kv)
            kb, vb = _unpack(kv, (k, v))
            allowed = allowed_mask(positions[me], positions[(me - step) % n], causal, seq_len, segments)
            if allowed is None or allowed.any():
                out, lse = merge(out, lse, *block_forward(q, kb, vb, allowed, scale))
            if ring is not None and step < n - 1:
                kv = ring.finish()
        if out is None or lse is None:  # every key hidden (a query chunk of padding only)
            out = torch.zeros_like(q)
            lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.positions, ctx.causal, ctx.seq_len, ctx.scale = comm, positions, causal, seq_len, scale
        ctx.segments = segments
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        comm, positions = ctx.comm, ctx.positions
        n, me = comm.size, comm.rank
        ring = RingPass(comm) if n > 1 else None
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(q)
        travelling = _pack(k, v, torch.zeros_like(k), torch.zeros_like(v))  # the block and its gradient
        like = (k, v, k, v)
        for step in range(n):
            kb, vb, dkb, dvb = _unpack(travelling, like)
            allowed = allowed_mask(positions[me], positions[(me - step) % n], ctx.causal, ctx.seq_len, ctx.segments)
            if allowed is None or allowed.any():
                dq_b, dk_b, dv_b = block_backward(q, kb, vb, allowed, ctx.scale, lse, dout, delta, out)
                dq += dq_b
                dkb += dk_b
                dvb += dv_b
            if ring is not None:
                # the last hop carries only the gradient home (the block's owner is the next rank)
                ring.start(travelling if step < n - 1 else _pack(dkb, dvb))
                travelling = ring.finish()
        dk, dv = _unpack(travelling, (k, v)) if n > 1 else _unpack(travelling, like)[2:]
        return dq, dk, dv, None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: CommGroup,
                   positions: Sequence[torch.Tensor], causal: bool = True, seq_len: Optional[int] = None,
                   scale: Optional[float] = None, segments: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of this rank's queries to every rank's keys around ``comm``'s ring.

    ``q`` [b, h, s, d], ``k``/``v`` [b, hk, s, d] (``h`` a multiple of ``hk``): this rank's tokens, whose
    global positions are ``positions[comm.rank]``; ``positions[j]`` are ring rank ``j``'s. Keys at
    positions ``>= seq_len`` (padding) are never attended to. ``segments`` [b, padded length] (optional):
    the segment id of every global position (``softmax_merge.segment_ids``): a query attends only to keys
    of its segment, never to segment -1. Returns [b, h, s, d]."""
    if len(positions) != comm.size:
        raise ValueError(f"ring_attention needs the positions of all {comm.size} ranks, got {len(positions)}")
    limit = int(max(int(p.max()) for p in positions)) + 1 if seq_len is None else seq_len
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if segments is not None:
        segments = segments.to(q.device)
    return _RingAttention.apply(q, k, v, comm, [p.to(q.device) for p in positions], causal, limit, scale, segments)
