"""The one order in which a reduce-scatter adds the ranks' contributions: a fixed binary tree over the
ranks, in rank order, whichever rank owns the chunk.

Floating-point addition is commutative but not associative: rank 2 adding ``((c1 + c2) + c0) + c3`` and
rank 0 adding ``((c3 + c0) + c2) + c1`` give different bits. Every element, wherever a layout puts it
(ZeRO stage 0's all-reduce, the bucket chunks of stages 1-2, the module-group chunks of stage 3, any
data-parallel size), is therefore summed as the same tree: over ranks ``[lo, hi)`` the sum is
``sum[lo, lo + P) + sum[lo + P, hi)`` with ``P`` the largest power of two below ``hi - lo``, so for 4
ranks ``(c0 + c1) + (c2 + c3)``, for 3 ``(c0 + c1) + c2``. An aligned run of ``2^j`` ranks is a subtree,
which is what lets the deterministic mode continue the same tree over accumulation steps
(``deepshard/zero/canonical.py``). 16-bit contributions from more than two ranks are summed in fp32 and
rounded once.

The evaluator works on *values*: the other ranks' chunks (tensors, writable scratch or read-only) and
this rank's own chunk, which arrives as pieces (``OwnChunk``) and is never written.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


def split_point(lo: int, hi: int) -> int:
    """Where the canonical tree splits ranks ``[lo, hi)`` (``hi - lo >= 2``)."""
    span = hi - lo
    power = 1 << (span - 1).bit_length() - 1
    return lo + power


@dataclass
class OwnChunk:
    """This rank's own contribution: ``parts`` are ``(offset in the chunk, 1-D tensor)``, zero elsewhere."""

    parts: list[tuple[int, torch.Tensor]]

    def add_into(self, dst: torch.Tensor) -> None:
        """``dst += own``."""
        for at, t in self.parts:
            dst[at:at + t.numel()].add_(t)

    def add_out(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst = src + own`` (``dst`` may have a wider dtype than ``src``: the sum is then taken in it)."""
        if dst.dtype != src.dtype:
            dst.copy_(src)
            self.add_into(dst)
            return
        covered = 0
        for at, t in self.parts:
            if at > covered:
                dst[covered:at].copy_(src[covered:at])
            torch.add(src[at:at + t.numel()], t, out=dst[at:at + t.numel()])
            covered = at + t.numel()
        if covered < dst.numel():
            dst[covered:].copy_(src[covered:])

    def write(self, dst: torch.Tensor) -> None:
        """``dst = own``."""
        dst.zero_()
        self.add_into(dst)


@dataclass
class _Value:
    tensor: Optional[torch.Tensor]  # None: the own chunk
    writable: bool
    temp: bool = False


def tree_sum(size: int, rank: int, other: Callable[[int], torch.Tensor], own: OwnChunk, writable: bool,
             temp: Callable[[], torch.Tensor], release: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """The canonical sum over ranks ``0 .. size - 1`` of ``other(r)`` (r != rank) and ``own``. Writes into
    the others' tensors when ``writable`` (scratch the caller owns), else into ``temp()`` buffers (of the
    dtype the sum is taken in), which it hands back with ``release`` once consumed; returns the tensor
    holding the sum (one of those)."""
    if size < 2:
        raise ValueError(f"tree_sum needs at least 2 ranks, got {size}")

    def leaf(r: int) -> _Value:
        return _Value(None, False) if r == rank else _Value(other(r), writable)

    def add(a: _Value, b: _Value) -> _Value:
        if a.tensor is None:
            a, b = b, a  # addition commutes: the own chunk is always the operand added in
        assert a.tensor is not None  # only one own chunk exists
        if b.tensor is None:
            if a.writable:
                own.add_into(a.tensor)
                return a
            out = temp()
            own.add_out(a.tensor, out)
            return _Value(out, True, True)
        for dst, src in ((a, b), (b, a)):
            if dst.writable and dst.tensor.dtype == src.tensor.dtype or dst.temp:
                dst.tensor.add_(src.tensor)
                if src.temp:
                    release(src.tensor)
                return dst
        out = temp()
        if out.dtype == a.tensor.dtype:
            torch.add(a.tensor, b.tensor, out=out)
        else:  # widen first, then add
            out.copy_(a.tensor)
            out.add_(b.tensor)
        return _Value(out, True, True)

    def evaluate(lo: int, hi: int) -> _Value:
        if hi - lo == 1:
            return leaf(lo)
        mid = split_point(lo, hi)
        return add(evaluate(lo, mid), evaluate(mid, hi))

    try:
        result = evaluate(0, size)
    finally:
        # ``evaluate`` refers to itself (a reference cycle through its closure cell, reaching ``other``'s
        # buffers): cleared here, so the receive buffers go when the caller drops them, not at the next
        # garbage collection (which raised the peak of live tensors, by a rank-dependent amount)
        del evaluate
    assert result.tensor is not None
    return result.tensor
