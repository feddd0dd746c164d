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

That *interleaved* split (atom ``step x dp + rank``) costs stages 0 and 1 a reduce-scatter per micro-step,
where the default mode reduces once per step. They hold whole gradients, so they can take the *contiguous*
split instead (atom ``rank x gas + step``, :func:`contiguous_split`): each rank adds its own ``gas``
micro-batches in the tree (:class:`StepTree` over its whole gradient, ``zero/local_steps.py``), which is
the subtree over atoms ``[rank x gas, (rank + 1) x gas)`` when ``gas`` is a power of two, and one
reduce-scatter at the boundary adds the ranks' subtrees in the tree over ranks: the same tree again,
for the cost of the default mode. Which micro-batch a rank trains at each micro-step therefore depends on
the split (:func:`atom_index`; the engine's loader and ``engine.atom_index`` follow it).
"""
from __future__ import annotations

import torch


def contiguous_split(stage: int, steps: int, grad_dtype: torch.dtype, comm_dtype: torch.dtype | None) -> bool:
    """Whether the deterministic mode gives each rank consecutive atoms (``rank x steps + step``) and reduces
    once per global batch: at stages 0 and 1 (whole gradients on every rank), with a power-of-two number of
    accumulation steps (a rank's atoms are then a subtree), when gradients are fp32 and reduced in fp32.
    (16-bit contributions of more than two ranks are summed in fp32 and rounded once, ``comm/tree_sum.py``:
    adding a rank's micro-steps in 16 bits first would round elsewhere than stages 2 and 3 do.)"""
    wide = grad_dtype == torch.float32 and comm_dtype in (None, torch.float32)
    return stage in (0, 1) and steps > 1 and steps & (steps - 1) == 0 and wide


def atom_index(rank: int, step: int, ranks: int, steps: int, contiguous: bool) -> int:
    """The micro-batch (atom) of a global batch that data-parallel ``rank`` trains at accumulation step
    ``step`` of ``steps``, over ``ranks`` ranks, in the contiguous or the interleaved split."""
    if not (0 <= rank < ranks and 0 <= step < steps):
        raise ValueError(f"rank {rank} of {ranks}, accumulation step {step} of {steps}: out of range")
    return rank * steps + step if contiguous else step * ranks + rank


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

    @property
    def depth(self) -> int:
        """The index of the buffer ``current()`` returns (0: ``base``)."""
        return len(self.counts)

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

    def closing_adds(self) -> list[int]:
        """The additions ``commit()`` then ``finish()`` would make now, in order: ``i`` stands for
        ``buffers[i - 1] += buffers[i]``. Applied range by range (``close_range``), they let each bucket
        be closed as soon as its gradients exist; ``reset()`` then starts over."""
        counts, adds = self.counts + [1], []
        while len(counts) >= 2 and counts[-1] == counts[-2]:
            adds.append(len(counts) - 1)
            counts[-2] *= 2
            counts.pop()
        while len(counts) > 1:
            adds.append(len(counts) - 1)
            span = counts.pop()
            counts[-1] += span
        return adds

    @torch.no_grad()
    def close_range(self, adds: list[int], lo: int, hi: int) -> None:
        """Apply ``closing_adds()`` to elements ``[lo, hi)``: their sum lands in ``base``."""
        for i in adds:
            self.buffers[i - 1][lo:hi].add_(self.buffers[i][lo:hi])

    def reset(self) -> None:
        """Start over (after ``close_range`` has closed every element)."""
        self.counts.clear()

    @property
    def pending(self) -> int:
        """Micro-steps committed since the last ``finish``."""
        return sum(self.counts)

    def nbytes(self) -> int:
        """Bytes of the partial-sum buffers beyond ``base``."""
        return sum(b.numel() * b.element_size() for b in self.buffers[1:])
