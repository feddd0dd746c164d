"""A bounded pool of equal staging buffers: what keeps offloaded training's resident memory fixed.

Buffers are allocated on first use, up to ``count``, and reused after. A buffer handed to an
asynchronous write comes back when the write completes (``release_after``), so a reader waiting for
buffers waits exactly for write-behind to drain. If a request could never be met (more buffers asked
for than exist, none on their way back), the pool grows past ``count`` once and says so, rather than
deadlocking: that happens when ``buffer_count`` is below the number of tensors one sub-group needs.
"""
from __future__ import annotations

import threading

import torch

from deepshard.utils.logging import logger
from deepshard.zero.offload.swapper import IOOp


class BufferPool:
    """``count`` uint8 buffers of ``nbytes`` each (pinned when ``pin``)."""

    def __init__(self, count: int, nbytes: int, pin: bool = False, what: str = "offload_optimizer") -> None:
        if count < 1:
            raise ValueError(f"zero_optimization.{what}.buffer_count ({count}) must be at least 1")
        self.count, self.nbytes, self.pin, self.what = count, max(int(nbytes), 1), pin, what
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._returning = 0
        self._cond = threading.Condition()
        self._warned = False

    @property
    def allocated_bytes(self) -> int:
        return self._allocated * self.nbytes

    def _new(self) -> torch.Tensor:
        self._allocated += 1
        return torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def acquire(self, n: int, block: bool = True) -> list[torch.Tensor] | None:
        """``n`` buffers; ``None`` when ``block`` is False and they are not available now."""
        with self._cond:
            while True:
                available = len(self._free) + (self.count - self._allocated)
                if available >= n:
                    return [self._free.pop() if self._free else self._new() for _ in range(n)]
                if not block:
                    return None
                if self._returning == 0:
                    self._grow(n)
                    return [self._free.pop() if self._free else self._new() for _ in range(n)]
                self._cond.wait()

    def _grow(self, n: int) -> None:
        missing = n - len(self._free) - max(self.count - self._allocated, 0)
        if not self._warned:
            logger.warning("zero_optimization.%s.buffer_count (%d) is smaller than the %d staging buffers one "
                           "sub-group needs here; using %d. Set buffer_count to at least twice the tensors per "
                           "sub-group (master weights + each optimizer state) so reads and writes overlap the "
                           "update", self.what, self.count, n, self.count + missing)
            self._warned = True
        self.count += missing

    def release(self, buffers: list[torch.Tensor]) -> None:
        with self._cond:
            self._free.extend(buffers)
            self._cond.notify_all()

    def release_after(self, buffers: list[torch.Tensor], ops: list[IOOp]) -> None:
        """Return ``buffers`` once every operation in ``ops`` is finished."""
        if not ops:
            self.release(buffers)
            return
        with self._cond:
            self._returning += len(buffers)
        state = {"left": len(ops)}
        lock = threading.Lock()

        def one_done(_: IOOp) -> None:
            with lock:
                state["left"] -= 1
                last = state["left"] == 0
            if last:
                with self._cond:
                    self._returning -= len(buffers)
                    self._free.extend(buffers)
                    self._cond.notify_all()

        for op in ops:
            op.add_done_callback(one_done)

    def clear(self) -> None:
        """Drop the free buffers (the pool can still allocate again)."""
        with self._cond:
            self._allocated -= len(self._free)
            self._free.clear()
