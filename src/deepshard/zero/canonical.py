"""The deterministic mode's sum over micro-batches: one tree over every micro-batch of a global batch,
whatever the data-parallel size and accumulation split (``"deterministic": true``, docs/determinism.md).

A global batch of ``A`` micro-batches (*atoms*) is trained as ``dp`` ranks x ``gas`` accumulation steps
with ``dp x gas = A``; atom ``a = micro_step x dp + rank``. Its gradient is defined as the canonical tree
(``comm/tree_sum.py``: spans split after their largest power of two) over the atoms' gradients, times
``1 / A``. Each micro-step's reduce-scatter sums the ``dp`` atoms of that step in the tree over ranks,
which is the subtree over atoms ``[step x dp, (step + 1) x dp)`` when ``dp`` is a power of two, and
:class:`StepTree` continues the tree over the steps' sums as a binary counter: after each step, the two
newest partial sums are added while they cover equally many steps; at the boundary the rest are added
newest first. So dp=1 x 8, 2 x 4, 4 x 2 and 8 x 1 all compute ``((a0 + a1) + (a2 + a3)) + ((a4 + a5) +
(a6 + a7))`` for every element, and the ``1 / A`` is applied once, at the end. No micro-batch's gradient
is divided before the sum (the engine does not divide the loss by ``gas`` in this mode).

Memory: the partial sums, at most ``floor(log2(gas)) + 1`` tensors the size of the reduced region (a
rank's gradient shard at stages 1-3 and its chunks of the buckets at stage 0), the first of them the
region itself.
"""
from __future__ import annotations

import torch


class StepTree:
    """The canonical sum over accumulation steps of one reduced region (``base``: where the result lands).

    Each micro-step writes its reduced values into ``current()`` (every element, overwriting), then calls
    ``commit()``; after the boundary's ``commit()``, ``finish(factor)`` leaves the sum times ``factor`` in
    ``base`` and starts over."""

    def __init__(self, base: torch.Tensor) -> None:
        self.base = base
        self.buffers: list[torch.Tensor] = [base]
        self.counts: list[int] = []  # steps summed in each pending partial sum, oldest first

    def current(self) -> torch.Tensor:
        """Where this micro-step's reduced values go (the next free partial-sum buffer)."""
        depth = len(self.counts)
        while len(self.buffers) <= depth:
            self.buffers.append(torch.empty_like(self.base))
        return self.buffers[depth]

    @torch.no_grad()
    def commit(self) -> None:
        """This micro-step's values are in ``current()``: add partial sums of equal span (binary counter)."""
        self.counts.append(1)
        while len(self.counts) >= 2 and self.counts[-1] == self.counts[-2]:
            top = len(self.counts) - 1
            self.buffers[top - 1].add_(self.buffers[top])
            self.counts[-2] *= 2
            self.counts.pop()

    @torch.no_grad()
    def finish(self, factor: float) -> torch.Tensor:
        """Add the remaining partial sums, newest first, multiply by ``factor``: the result is ``base``."""
        if not self.counts:
            raise RuntimeError("StepTree.finish() before any micro-step was committed")
        while len(self.counts) > 1:
            top = len(self.counts) - 1
            self.buffers[top - 1].add_(self.buffers[top])
            span = self.counts.pop()
            self.counts[-1] += span
        self.counts.clear()
        if factor != 1.0:
            self.base.mul_(factor)
        return self.base

    @property
    def pending(self) -> int:
        """Micro-steps committed since the last ``finish``."""
        return sum(self.counts)

    def nbytes(self) -> int:
        """Bytes of the partial-sum buffers beyond ``base``."""
        return sum(b.numel() * b.element_size() for b in self.buffers[1:])
