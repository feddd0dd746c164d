"""An async handle over a collective made of several dependent collectives (a two-hop reduce-scatter, a
quantized gather and its decoding, a reduce-scatter followed by an all-reduce across replicas).

The algorithm is written as a generator: it launches a collective and yields its handle, computes on
the result once the handle is done, launches the next, ... and returns the final tensor. The first
collective starts when the ``StagedWork`` is made; each later one starts when the caller's ``wait()`` has
seen the one before complete, so the handles in flight, their order and their tags are the same on
every rank (each rank runs the same generator).
"""
from __future__ import annotations

import datetime
import time
from typing import Any, Generator, Optional

import torch

Stages = Generator[Any, None, Optional[torch.Tensor]]
"""Yields the handle of each collective it launched; returns the result (or None)."""


class StagedWork:
    """``wait()`` runs ``stages`` to the end; ``result`` is what it returned. ``scratch_bytes``: the
    memory its buffers hold while in flight (the reducers' accounting)."""

    def __init__(self, stages: Stages, scratch_bytes: int = 0) -> None:
        self._stages: Optional[Stages] = stages
        self.result: Optional[torch.Tensor] = None
        self.scratch_bytes = scratch_bytes
        self._current: Any = None
        self._advance()

    def _advance(self) -> None:
        """Run the generator to its next launched collective (or its end)."""
        if self._stages is None:
            return
        try:
            self._current = next(self._stages)
        except StopIteration as done:
            self._current, self._stages = None, None
            self.result = done.value

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        """Complete every stage; with ``timeout``, False when they did not finish in time (the handle can
        be waited on again)."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while self._current is not None:
            if deadline is None:
                self._current.wait()
            else:
                left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
                if self._current.wait(timeout=left) is False:
                    return False
            self._advance()
        return True

    def is_completed(self) -> bool:
        return self._current is None
