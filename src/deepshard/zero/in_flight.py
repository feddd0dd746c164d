"""The gradient collectives a reducer has in flight: oldest first, at most ``limit`` at once.

Every ZeRO reducer (stages 1, 2 and 3) launches a reduce-scatter per bucket or group as backward
produces it and completes them in launch order; the limit bounds the memory they hold (their scratch and
the gradients they read). ``finish`` completes one item: wait, then write the reduced chunk where it goes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


def averaging_factor(predivide: float, world: int, average: bool) -> float:
    """What a reduced sum is multiplied by after a ``predivide`` before it: 1/N overall when averaging."""
    return (predivide / world) if average else predivide


def averaged(chunk: torch.Tensor, dtype: torch.dtype, factor: float) -> torch.Tensor:
    """A reduced chunk in the gradient's ``dtype``, times the averaging ``factor``: converted first, then
    multiplied (in place: the chunk is the collective's fresh result), the arithmetic every stage applies to
    its reduced gradient, so each element gets the same bits at every stage. (``add_(x, alpha=f)`` would
    not do: on 16-bit tensors torch rounds ``alpha`` to 16 bits first.)"""
    out = chunk if chunk.dtype == dtype else chunk.to(dtype)
    return out.mul_(factor) if factor != 1.0 else out


@dataclass
class InFlight:
    index: int                   # the bucket or group
    work: Any                    # the collective's handle
    out: torch.Tensor | None = None
    held: list[torch.Tensor] = field(default_factory=list)  # what the collective reads until it is done


class InFlightQueue:
    def __init__(self, limit: int, finish: Callable[[InFlight], None]) -> None:
        self.limit = max(1, limit)
        self.finish = finish
        self.items: list[InFlight] = []

    def make_room(self) -> None:
        """Complete the oldest items until one more may be launched."""
        while len(self.items) >= self.limit:
            self.finish(self.items.pop(0))

    def add(self, item: InFlight) -> None:
        self.items.append(item)

    def drain(self) -> None:
        while self.items:
            self.finish(self.items.pop(0))

    def scratch_bytes(self) -> int:
        """Memory held by the collectives in flight (zero outside backward)."""
        return sum(int(getattr(item.work, "scratch_bytes", 0)) for item in self.items)
