"""A rank's own micro-steps summed in the canonical tree: the deterministic mode's contiguous split at
ZeRO stages 0 and 1 (``zero/canonical.py``).

Each micro-step's gradients land in a buffer of their own (``.grad`` points at views into it), cleared
first; between micro-steps the buffers are added as the tree's binary counter says. At the boundary's
micro-step each range (a bucket) is closed as soon as its gradients exist: its remaining partial sums are
added into the base buffer, the one the reducer then reduces over ranks. The sum is computed as a tree of
whole micro-step gradients, never by autograd adding into an older sum (``((g0 + g1) + g2) + g3`` is not
``(g0 + g1) + (g2 + g3)``).
"""
from __future__ import annotations

import torch

from deepshard.zero.canonical import StepTree


class LocalSteps:
    """The tree over a rank's micro-steps of one gradient buffer ``base``, whose parameters' ``.grad``
    are ``base[start:start + numel].view(shape)`` for each ``(param, start)`` of ``slots``. ``predivide``
    divides each micro-step's gradient before it joins the tree (``gradient_predivide_factor``)."""

    def __init__(self, base: torch.Tensor, slots: list[tuple[torch.nn.Parameter, int]], predivide: float = 1.0) -> None:
        self.tree = StepTree(base)
        self.slots = slots
        self.predivide = predivide
        self._views: dict[int, list[torch.Tensor]] = {}
        self._adds: list[int] | None = None  # the boundary's closing additions, once planned

    def views(self, depth: int | None = None) -> list[torch.Tensor]:
        """The gradient views into buffer ``depth`` (default: the current micro-step's), in slot order."""
        depth = self.tree.depth if depth is None else depth
        if depth not in self._views:
            buffer = self.tree.buffers[0] if depth == 0 else self.tree.current()
            self._views[depth] = [buffer[at:at + p.numel()].view_as(p) for p, at in self.slots]
        return self._views[depth]

    @property
    def depth(self) -> int:
        return self.tree.depth

    @torch.no_grad()
    def begin(self) -> bool:
        """A micro-step starts. Past the first of a global batch, its buffer is cleared and every ``.grad``
        points into it; returns whether that happened (False: the base buffer, handled by the caller)."""
        if self.tree.depth == 0:
            return False
        self.tree.current().zero_()
        for (p, _), view in zip(self.slots, self.views()):
            p.grad = view
        return True

    @torch.no_grad()
    def commit(self) -> None:
        """A micro-step before the boundary has its gradients: add it into the tree."""
        if self.predivide != 1.0:
            self.tree.current().div_(self.predivide)
        self.tree.commit()

    @torch.no_grad()
    def close(self, lo: int = 0, hi: int | None = None) -> None:
        """At the boundary's micro-step, elements ``[lo, hi)`` have their gradients: add the tree's partial
        sums there, so that ``base[lo:hi]`` holds this rank's canonical sum."""
        if self._adds is None:
            self._adds = self.tree.closing_adds()
        hi = self.tree.base.numel() if hi is None else hi
        if self.predivide != 1.0:
            self.tree.current()[lo:hi].div_(self.predivide)
        self.tree.close_range(self._adds, lo, hi)

    def finish(self) -> None:
        """After every range was closed: start over, every ``.grad`` pointing into the base buffer."""
        self.tree.reset()
        self._adds = None
        for (p, _), view in zip(self.slots, self.views(0)):
            p.grad = view

    def nbytes(self) -> int:
        """Bytes of the partial-sum buffers beyond the base."""
        return self.tree.nbytes()
