"""The autotuner's progress: trial k of N, elapsed time and the time left, as trials finish.

A tqdm bar on a terminal (the last trial's result beside it), else one log line per finished trial
carrying the same numbers. N grows when the search adds trials (repeats of the leaders, the second phase).
"""
from __future__ import annotations

import sys
import time
from typing import Any

from deepshard.utils.logging import logger
from deepshard.utils.progress import bars_on, format_seconds


class TrialProgress:
    """Counts finished trials against the planned total; the time left is the mean trial time so far
    times the trials left."""

    def __init__(self, total: int, clock: Any = time.monotonic) -> None:
        self.total, self.done, self._clock = total, 0, clock
        self._start = clock()
        self._bar: Any = None
        if bars_on():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc="autotuning", unit="trial", file=sys.stderr, dynamic_ncols=True)

    def add(self, count: int) -> None:
        """``count`` more trials are planned."""
        self.total += count
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def eta_s(self) -> float:
        if self.done == 0:
            return float("nan")
        return (self._clock() - self._start) / self.done * max(self.total - self.done, 0)

    def line(self, name: str, result: str) -> str:
        eta = self.eta_s()
        left = "?" if eta != eta else format_seconds(eta)
        return (f"autotuning: trial {self.done} of {self.total}: {name} -> {result} "
                f"(elapsed {format_seconds(self._clock() - self._start)}, about {left} left)")

    def finished(self, name: str, result: str) -> None:
        """A trial ended with ``result`` (e.g. ``ok, throughput 41.2``)."""
        self.done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(f"{name}: {result}", refresh=False)
            self._bar.update(1)
        else:
            logger.info(self.line(name, result))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
