"""Blockwise attention with the online-softmax merge, forward and backward, in plain torch.

A block is the attention of some queries to some keys, with a boolean ``allowed`` mask (query x key).
Its result is ``(out, lse)``: the softmax-weighted values and the log-sum-exp of the scores per query
row. Two blocks over disjoint key sets merge exactly (``merge``): the result is the attention over their
union. The backward of one block needs only the merged ``out``, ``lse`` and ``dout`` (as in
FlashAttention), so a ring never keeps other ranks' blocks.

Grouped-query attention: ``q`` has ``h`` heads, ``k``/``v`` have ``hk`` (``h`` a multiple), and query head
``i`` reads key head ``i // (h // hk)`` (Hugging Face's ``repeat_kv`` order). The groups are folded into
the query rows, so key/value gradients come out summed per key head.
"""
from __future__ import annotations

from typing import Optional

import torch

NEG_INF = float("-inf")


def _fold(q: torch.Tensor, hk: int) -> torch.Tensor:
    """[b, h, s, d] -> [b, hk, g*s, d] (query rows grouped under their key head)."""
    b, h, s, d = q.shape
    return q.reshape(b, hk, (h // hk) * s, d)


def _scores(q: torch.Tensor, k: torch.Tensor, allowed: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    hk = k.shape[1]
    groups = q.shape[1] // hk
    scores = torch.matmul(_fold(q, hk), k.transpose(-1, -2)) * scale  # [b, hk, g*sq, sk]
    if allowed is not None:
        scores = scores.masked_fill(~allowed.repeat(groups, 1), NEG_INF)
    return scores


def _safe(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with fully masked rows (-inf) set to 0, so ``exp(scores - lse)`` is 0 there, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Optional[torch.Tensor],
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, h, sq, d], lse [b, h, sq])`` of ``q`` attending to ``k``/``v`` where ``allowed``."""
    b, h, sq, d = q.shape
    scores = _scores(q, k, allowed, scale)
    lse = torch.logsumexp(scores, dim=-1)  # [b, hk, g*sq]
    probs = torch.exp(scores - _safe(lse).unsqueeze(-1))
    out = torch.matmul(probs, v)
    return out.reshape(b, h, sq, v.shape[-1]), lse.reshape(b, h, sq)


def merge(out: Optional[torch.Tensor], lse: Optional[torch.Tensor], block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of two disjoint key sets, from each one's ``(out, lse)``."""
    if out is None or lse is None:
        return block_out, block_lse
    total = torch.logaddexp(lse, block_lse)
    safe = _safe(total)
    w_old = torch.where(torch.isinf(total), torch.zeros_like(total), torch.exp(lse - safe))
    w_new = torch.where(torch.isinf(total), torch.zeros_like(total), torch.exp(block_lse - safe))
    return out * w_old.unsqueeze(-1) + block_out * w_new.unsqueeze(-1), total


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Optional[torch.Tensor], scale: float,
                   lse: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block's share, given the merged ``lse`` [b, h, sq], the output gradient
    ``dout`` and ``delta = (dout * out).sum(-1)`` of the merged output."""
    b, h, sq, d = q.shape
    hk = k.shape[1]
    scores = _scores(q, k, allowed, scale)
    probs = torch.exp(scores - _safe(_fold(lse.unsqueeze(-1), hk)))  # [b, hk, g*sq, sk]
    dout_f = _fold(dout, hk)
    dv = torch.matmul(probs.transpose(-1, -2), dout_f)
    dprobs = torch.matmul(dout_f, v.transpose(-1, -2))
    dscores = probs * (dprobs - _fold(delta.unsqueeze(-1), hk))
    dq = torch.matmul(dscores, k) * scale
    dk = torch.matmul(dscores.transpose(-1, -2), _fold(q, hk)) * scale
    return dq.reshape(b, h, sq, d), dk, dv


def allowed_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, seq_len: int) -> Optional[torch.Tensor]:
    """Which (query, key) pairs attend: keys past ``seq_len`` (padding) never; later keys not when causal.
    None when everything is allowed."""
    valid = (k_pos < seq_len).unsqueeze(0)
    if causal:
        allowed = (q_pos.unsqueeze(1) >= k_pos.unsqueeze(0)) & valid
    else:
        allowed = valid.expand(q_pos.numel(), k_pos.numel())
    return None if bool(allowed.all()) else allowed
