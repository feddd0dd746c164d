"""Blockwise attention with the online-softmax merge, forward and backward, in plain torch.

A block is the attention of some queries to some keys, where ``allowed`` (a boolean query x key mask, or a
``PositionMask`` built from global positions a slice of rows at a time) says which pairs attend.
Its result is ``(out, lse)``: the softmax-weighted values and the log-sum-exp of the scores per query
row. Two blocks over disjoint key sets merge exactly (``merge``): the result is the attention over their
union. The backward of one block needs only the merged ``out``, ``lse`` and ``dout`` (as in
FlashAttention), so a ring never keeps other ranks' blocks.

Where a block is plain (every key visible, or the causal diagonal: the same increasing positions on both
sides, no padding or packed documents) on a CPU in fp32/bf16/fp16, it runs torch's fused flash-attention
kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its backward, which take the merged ``out`` and
``lse`` the same way); other blocks are computed here, a slice of query rows at a time.

Grouped-query attention: ``q`` has ``h`` heads, ``k``/``v`` have ``hk`` (``h`` a multiple), and query head
``i`` reads key head ``i // (h // hk)`` (Hugging Face's ``repeat_kv`` order). The groups are folded into
the query rows, so key/value gradients come out summed per key head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch

NEG_INF = float("-inf")
ROW_BUDGET = 1 << 18
"""Score elements (query rows x keys) computed at once: longer blocks are done in slices of query rows, so
the memory of a block grows with its length, not its square."""


def _fold(q: torch.Tensor, hk: int) -> torch.Tensor:
    """[b, h, s, d] -> [b, hk, g*s, d] (query rows grouped under their key head)."""
    b, h, s, d = q.shape
    return q.reshape(b, hk, (h // hk) * s, d)


def _scores(qf: torch.Tensor, k: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """Scores of folded query rows ``qf`` [b, hk, rows, d] against ``k``; ``mask`` [rows, sk] or None."""
    scores = torch.matmul(qf, k.transpose(-1, -2)) * scale  # [b, hk, rows, sk]
    if mask is not None:
        scores = scores.masked_fill(~mask, NEG_INF)
    return scores


@dataclass(frozen=True)
class PositionMask:
    """Which (query, key) pairs attend, from their global positions: built a slice of query rows at a time
    (a whole [queries, keys] mask would grow with the square of the sequence).

    ``q_seg``/``k_seg`` [batch, tokens] (optional, together): the segment of each query and key (packed
    documents: a query attends only to keys of its own segment; a key of segment -1 is padding, never
    attended to). The mask is then [batch, 1, rows, keys]."""

    q_pos: torch.Tensor
    k_pos: torch.Tensor
    causal: bool
    seq_len: int
    q_seg: Optional[torch.Tensor] = None
    k_seg: Optional[torch.Tensor] = None

    def key_end(self, query_index: torch.Tensor) -> int:
        """Keys from this index on are hidden from every query of ``query_index`` (past the last one that is
        neither padding nor, when causal, after all of them): the slice computes only the keys before."""
        visible = self.k_pos < self.seq_len
        if self.causal:
            visible = visible & (self.k_pos <= self.q_pos[query_index].max())
        found = visible.nonzero()
        return int(found.max()) + 1 if found.numel() else 1

    def rows(self, query_index: torch.Tensor, key_end: Optional[int] = None) -> torch.Tensor:
        k_pos = self.k_pos[:key_end]
        allowed = (k_pos < self.seq_len).unsqueeze(0).expand(query_index.numel(), -1)
        if self.causal:
            allowed = allowed & (self.q_pos[query_index].unsqueeze(1) >= k_pos.unsqueeze(0))
        if self.q_seg is None or self.k_seg is None:
            return allowed
        k_seg = self.k_seg[:, :key_end]
        same = self.q_seg[:, query_index].unsqueeze(-1) == k_seg.unsqueeze(1)  # [b, rows, keys]
        return (allowed.unsqueeze(0) & same & (k_seg >= 0).unsqueeze(1)).unsqueeze(1)

    def any(self) -> bool:
        valid = self.k_pos[self.k_pos < self.seq_len]
        if valid.numel() == 0:
            return False
        return not self.causal or bool(self.q_pos.max() >= valid.min())


Mask = Union[torch.Tensor, PositionMask]


def _row_slices(q: torch.Tensor, k: torch.Tensor, allowed: Optional[Mask]
                ) -> Iterator[tuple[slice, Optional[torch.Tensor], int]]:
    """Slices of the folded query rows (group-major: row = group * sq + query) with their part of the mask
    and the number of leading keys they can see (causal: later keys are skipped, not computed and masked),
    one at a time (the masks of all slices together would be the whole quadratic mask)."""
    sq = q.shape[2]
    rows = q.shape[1] // k.shape[1] * sq
    step = max(1, ROW_BUDGET // max(1, k.shape[2] * k.shape[1] * k.shape[0]))
    for r in range(0, rows, step):
        index = torch.arange(r, min(r + step, rows), device=q.device) % sq
        end = k.shape[2]
        if allowed is None:
            mask = None
        elif isinstance(allowed, PositionMask):
            end = allowed.key_end(index)
            mask = allowed.rows(index, end)
        else:
            mask = allowed[index]
        yield slice(r, r + step), mask, end


def _safe(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with fully masked rows (-inf) set to 0, so ``exp(scores - lse)`` is 0 there, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _flash_ok(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's fused CPU kernel takes these tensors at all."""
    return q.device.type == "cpu" and q.dtype in _FLASH_DTYPES and q.shape[-1] == v.shape[-1] \
        and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _flash_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Optional[Mask]) -> Optional[bool]:
    """Whether torch's fused CPU kernel computes this block: ``False`` (every key visible), ``True`` (the
    causal diagonal), ``None`` (a mask it cannot express: computed here)."""
    if not _flash_ok(q, v):
        return None
    if allowed is None:
        return False
    if not isinstance(allowed, PositionMask) or not allowed.causal or allowed.q_seg is not None:
        return None
    pos = allowed.q_pos
    if pos.shape != allowed.k_pos.shape or not torch.equal(pos, allowed.k_pos) or bool((pos >= allowed.seq_len).any()):
        return None
    return True if pos.numel() < 2 or bool((pos[1:] > pos[:-1]).all()) else None


def _repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for their query heads (query head ``i`` reads key head ``i // groups``)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = q.shape[1] // k.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, _repeat_kv(k, g), _repeat_kv(v, g), 0.0, causal, scale=scale)
    return out, lse  # lse in fp32 whatever the dtype: the backward reads it back exactly


def _flash_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                    out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, hk, sk, d = k.shape
    g = q.shape[1] // hk
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, _repeat_kv(k, g), _repeat_kv(v, g), out.to(q.dtype), lse.float(), 0.0, causal, scale=scale)
    if g > 1:  # gradients of the repeated heads summed onto their key head
        dk, dv = (t.view(b, hk, g, sk, -1).sum(2) for t in (dk, dv))
    return dq, dk, dv


def _runs(pos: torch.Tensor) -> list[slice]:
    """The stretches of consecutive positions in ``pos`` (a head-tail shard has two)."""
    breaks = ((pos[1:] - pos[:-1]) != 1).nonzero().flatten().tolist()
    starts, ends = [0] + [b + 1 for b in breaks], [b + 1 for b in breaks] + [pos.numel()]
    return [slice(a, e) for a, e in zip(starts, ends)]


@dataclass(frozen=True)
class _RunPairs:
    """A block cut where its queries' and keys' positions jump: each (query run, key run) pair is then
    hidden, fully visible or a causal diagonal (for equal chunks), which the fused kernel computes."""

    allowed: PositionMask
    q_runs: list[slice]
    k_runs: list[slice]

    def pairs(self) -> Iterator[tuple[slice, slice, Optional[Mask]]]:
        a = self.allowed
        for qs in self.q_runs:
            for ks in self.k_runs:
                sub = allowed_mask(a.q_pos[qs], a.k_pos[ks], a.causal, a.seq_len)
                if sub is None or sub.any():
                    yield qs, ks, sub


def _run_pairs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Optional[Mask]) -> Optional[_RunPairs]:
    if not isinstance(allowed, PositionMask) or allowed.q_seg is not None or not _flash_ok(q, v):
        return None
    q_runs, k_runs = _runs(allowed.q_pos), _runs(allowed.k_pos)
    if len(q_runs) * len(k_runs) < 2 or len(q_runs) * len(k_runs) > 16:
        return None
    return _RunPairs(allowed, q_runs, k_runs)


def _forward_by_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: _RunPairs,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_zeros(*q.shape[:3], v.shape[-1])
    lse = torch.full(q.shape[:3], NEG_INF, dtype=torch.float32, device=q.device)
    merged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for qs, ks, sub in runs.pairs():
        part = block_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], sub, scale)
        prev = merged.get(qs.start)
        merged[qs.start] = part if prev is None else merge(*prev, *part)
    for qs in runs.q_runs:
        if qs.start in merged:
            out[:, :, qs], lse[:, :, qs] = merged[qs.start]
    return out, lse


def _backward_by_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: _RunPairs, scale: float,
                      lse: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor, out: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qs, ks, sub in runs.pairs():
        a, b, c = block_backward(q[:, :, qs], k[:, :, ks], v[:, :, ks], sub, scale, lse[:, :, qs],
                                 dout[:, :, qs], delta[:, :, qs], out[:, :, qs])
        dq[:, :, qs] += a
        dk[:, :, ks] += b
        dv[:, :, ks] += c
    return dq, dk, dv


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Optional[Mask],
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, h, sq, d], lse [b, h, sq])`` of ``q`` attending to ``k``/``v`` where ``allowed``."""
    causal = _flash_causal(q, k, v, allowed)
    if causal is not None:
        return _flash_forward(q, k, v, causal, scale)
    runs = _run_pairs(q, k, v, allowed)
    if runs is not None:
        return _forward_by_runs(q, k, v, runs, scale)
    b, h, sq, d = q.shape
    qf = _fold(q, k.shape[1])
    outs, lses = [], []
    for rows, mask, end in _row_slices(q, k, allowed):
        scores = _scores(qf[:, :, rows], k[:, :, :end], mask, scale)
        lse = torch.logsumexp(scores, dim=-1)  # [b, hk, rows]
        outs.append(torch.matmul(torch.exp(scores - _safe(lse).unsqueeze(-1)), v[:, :, :end]))
        lses.append(lse)
    return torch.cat(outs, 2).reshape(b, h, sq, v.shape[-1]), torch.cat(lses, 2).reshape(b, h, sq)


def merge(out: Optional[torch.Tensor], lse: Optional[torch.Tensor], block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of two disjoint key sets, from each one's ``(out, lse)``."""
    if out is None or lse is None:
        return block_out, block_lse
    total = torch.logaddexp(lse, block_lse)
    safe = _safe(total)
    w_old = torch.where(torch.isinf(total), torch.zeros_like(total), torch.exp(lse - safe))
    w_new = torch.where(torch.isinf(total), torch.zeros_like(total), torch.exp(block_lse - safe))
    merged = out * w_old.unsqueeze(-1) + block_out * w_new.unsqueeze(-1)
    return merged.to(block_out.dtype), total


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Optional[Mask], scale: float,
                   lse: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor, out: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block's share, given the merged ``lse`` [b, h, sq], the output gradient
    ``dout`` and ``delta = (dout * out).sum(-1)`` of the merged output (and the merged ``out`` itself, which
    the fused kernel reads instead of ``delta``)."""
    causal = _flash_causal(q, k, v, allowed) if out is not None else None
    if causal is not None and out is not None:
        return _flash_backward(q, k, v, causal, scale, out, lse, dout)
    runs = _run_pairs(q, k, v, allowed) if out is not None else None
    if runs is not None and out is not None:
        return _backward_by_runs(q, k, v, runs, scale, lse, dout, delta, out)
    lse = lse.to(q.dtype)  # fp32 where a fused block took part in the merge
    b, h, sq, d = q.shape
    hk = k.shape[1]
    qf, lse_f, dout_f, delta_f = (_fold(t, hk) for t in (q, lse.unsqueeze(-1), dout, delta.unsqueeze(-1)))
    dqs, dk, dv = [], torch.zeros_like(k), torch.zeros_like(v)
    for rows, mask, end in _row_slices(q, k, allowed):
        ks, vs = k[:, :, :end], v[:, :, :end]
        probs = torch.exp(_scores(qf[:, :, rows], ks, mask, scale) - _safe(lse_f[:, :, rows]))  # [b, hk, r, end]
        dv[:, :, :end] += torch.matmul(probs.transpose(-1, -2), dout_f[:, :, rows])
        dscores = probs * (torch.matmul(dout_f[:, :, rows], vs.transpose(-1, -2)) - delta_f[:, :, rows])
        dqs.append(torch.matmul(dscores, ks) * scale)
        dk[:, :, :end] += torch.matmul(dscores.transpose(-1, -2), qf[:, :, rows]) * scale
    return torch.cat(dqs, 2).reshape(b, h, sq, d), dk, dv


def allowed_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, seq_len: int,
                 segments: Optional[torch.Tensor] = None) -> Optional[PositionMask]:
    """Which (query, key) pairs attend: keys past ``seq_len`` (padding) never; later keys not when causal;
    with ``segments`` ([batch, padded length] segment ids by global position, -1 for padding) only keys of
    the query's segment. None when everything is allowed."""
    if segments is not None:
        return PositionMask(q_pos, k_pos, causal, seq_len, segments[:, q_pos], segments[:, k_pos])
    every_key_valid = bool(k_pos.max() < seq_len)
    if every_key_valid and (not causal or bool(q_pos.min() >= k_pos.max())):
        return None
    return PositionMask(q_pos, k_pos, causal, seq_len)


def segment_ids(position_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None
                ) -> Optional[torch.Tensor]:
    """The segment of each token of whole sequences [batch, tokens]: a new segment starts wherever a
    position id does not follow the previous one by 1 (packed documents, as transformers reads them);
    tokens whose ``attention_mask`` is 0 get -1 (never attended to). None when there is one segment and
    no padding (plain causal attention)."""
    seg = None
    if position_ids is not None:
        first = position_ids[:, :1] - 1
        seg = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
        if not bool((seg[:, -1] != 0).any()):
            seg = None
    if attention_mask is not None and not bool(attention_mask.all()):
        base = seg if seg is not None else torch.zeros(attention_mask.shape, dtype=torch.long,
                                                       device=attention_mask.device)
        seg = base.masked_fill(attention_mask == 0, -1)
    return seg
