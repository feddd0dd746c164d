"""``deepspeed.utils.pin_memory_tracker``: how much host memory this process has pinned (page-locked) for
fast device copies, and a log line each time the total passes 32 GB, 64 GB, 128 GB ... (pinned memory
cannot be swapped out, so it is worth knowing when a job holds a lot of it).

deepshard pins through the accelerator (``get_accelerator().pin_memory(t)``, CUDA only), which records each
pinned tensor here; :func:`pinned_memory_summary` logs the total.
"""
from __future__ import annotations

from deepshard.utils.logging import logger

__all__ = ["PinnedMemoryTracker", "pinned_memory_summary", "track_pinned_memory"]

GB = 1024 ** 3
FIRST_CHECKPOINT = 32 * GB


def _fmt_bytes(num_bytes: int) -> str:
    """``512`` -> ``"512 B"``, ``2048`` -> ``"2.0 KB"``, ``2**20`` -> ``"1.00 MB"``, ``2**30`` -> ``"1.000 GB"``."""
    if num_bytes < 1024:
        return f"{num_bytes} B"
    if num_bytes < 1024 ** 2:
        return f"{num_bytes / 1024:.1f} KB"
    if num_bytes < GB:
        return f"{num_bytes / 1024 ** 2:.2f} MB"
    return f"{num_bytes / GB:.3f} GB"


class PinnedMemoryTracker:
    """A running total of pinned bytes and calls, with doubling log checkpoints from 32 GB."""

    def __init__(self) -> None:
        self._bytes = 0
        self._calls = 0
        self._next_checkpoint = FIRST_CHECKPOINT

    def reset(self) -> None:
        self._bytes, self._calls, self._next_checkpoint = 0, 0, FIRST_CHECKPOINT

    def track(self, num_bytes: int) -> None:
        """Add one pinned allocation; log once per checkpoint the total has passed (the last one passed)."""
        self._bytes += int(num_bytes)
        self._calls += 1
        passed = None
        while self._bytes >= self._next_checkpoint:
            passed = self._next_checkpoint
            self._next_checkpoint *= 2
        if passed is not None:
            logger.info("pinned host memory checkpoint: %s passed %d GB (%d pinned allocations)",
                        _fmt_bytes(self._bytes), passed // GB, self._calls)

    def summary(self, tag: str = "") -> str:
        text = f"pinned host memory{f' ({tag})' if tag else ''}: {_fmt_bytes(self._bytes)} in {self._calls} allocations"
        logger.info(text)
        return text


_tracker = PinnedMemoryTracker()
"""This process's tracker (a counter, like a logger; it holds no process-group or parameter state)."""


def track_pinned_memory(num_bytes: int) -> None:
    """Record ``num_bytes`` of newly pinned host memory."""
    _tracker.track(num_bytes)


def pinned_memory_summary(tag: str = "") -> str:
    """Log (and return) the pinned total so far."""
    return _tracker.summary(tag)
