"""How attention heads are split over the Ulysses ranks when they do not divide evenly.

``head_plan(h, hk, n)`` says how to make the query heads ``h`` and key/value heads ``hk`` split over ``n``
ranks so that every query head lands on the rank that holds its key/value head:

- both divide by ``n``: sent as they are;
- ``h`` divides and ``n`` is a multiple of ``hk`` (GQA/MQA with fewer key heads than ranks): each key/value
  head is repeated ``n / hk`` times, one per rank;
- anything else: key/value heads are repeated up to ``h`` (plain multi-head), and all three are padded with
  zero heads up to a multiple of ``n``. A zero head attends uniformly to zero values: its output is zero
  and it is dropped after the exchange back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadPlan:
    kv_repeat: int
    pad: int

    def apply(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              dim: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.kv_repeat > 1:
            k = k.repeat_interleave(self.kv_repeat, dim=dim)
            v = v.repeat_interleave(self.kv_repeat, dim=dim)
        if self.pad:
            q, k, v = (_pad_heads(t, self.pad, dim) for t in (q, k, v))
        return q, k, v


def _pad_heads(t: torch.Tensor, pad: int, dim: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def head_plan(h: int, hk: int, n: int) -> HeadPlan:
    """The plan for ``h`` query and ``hk`` key/value heads over ``n`` ranks (see the module text)."""
    if h < 1 or hk < 1 or h % hk != 0:
        raise ValueError(f"{h} query heads cannot share {hk} key/value heads (h must be a multiple of hk)")
    if h % n == 0 and hk % n == 0:
        return HeadPlan(kv_repeat=1, pad=0)
    if h % n == 0 and n % hk == 0:
        return HeadPlan(kv_repeat=n // hk, pad=0)
    return HeadPlan(kv_repeat=h // hk, pad=(-h) % n)


def check_tensor_parallel_heads(h: int, hk: int, hv: int, sp: int, tp: int) -> None:
    """Under tensor parallelism the attention gets one tensor-parallel rank's heads (``h`` query, ``hk``
    key and ``hv`` value heads); they must be whole heads that still group (``h`` a multiple of ``hk``),
    else tp did not divide the model's head counts (the plan check reads them where the model says them)."""
    if hk == hv and hk >= 1 and h >= hk and h % hk == 0:
        return
    raise ValueError(f"sequence_parallel_size={sp} with tensor parallelism (tp={tp}): this tensor-parallel "
                     f"rank's attention holds {h} query heads and {hk} key / {hv} value heads, which do not "
                     f"group (query heads must be a multiple of the key/value heads); each tensor-parallel "
                     f"rank must hold whole heads (heads/tp and kv_heads/tp) before the sequence-parallel "
                     f"attention exchanges them, and tp={tp} does not divide the model's query and key/value "
                     f"head counts; use a tensor-parallel size dividing both counts, or tensor_parallel size 1 "
                     f"with sequence_parallel_size={sp}")
