"""Stage 0's gradient-reduction schedule, chosen by timing both while training.

Stage 0 all-reduces its gradient buckets either as backward produces them (overlapped with the rest of
backward) or once backward has finished. Which is faster depends on the host, not on the model:

- with a core (or a GPU) free for the communication, overlapping hides it behind backward;
- when other processes compete for the cores (data-loader workers, a second job, a busy node), the
  communication thread takes turns with backward on the same cores, and reducing once afterwards in
  large buckets wins (measured in docs/benchmarks.md).

So when the config leaves ``zero_optimization.overlap_comm`` unset, :class:`AdaptiveOverlap` times the
reducing backwards (from ``begin_backward`` to the end of ``end_backward``: backward plus whatever of
the reduction it waits for) both ways, alternating, and keeps the faster one; it probes again every
``recheck_every`` reducing backwards, since the load on a host changes. ``overlap_comm`` true or false
forces a schedule. Both schedules issue the same collectives with the same values, so the choice changes
timing only, never the results. The ranks still decide together (``agree``: the medians summed over the
group, one two-number all-reduce per decision): a rank that overlapped while another reduced afterwards
would order its bucket all-reduces differently against collectives issued inside backward (a mixture of
experts layer's all-to-all, a tensor-parallel all-reduce) on a group the two share.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

from deepshard.utils.logging import logger


class AdaptiveOverlap:
    """Alternates the two schedules for ``2 * probes`` reducing backwards (after ``settle`` untimed ones:
    first-use allocations), keeps the one with the lower median time, and probes again after
    ``recheck_every`` more. ``next_overlap()`` at each reducing ``begin_backward``; ``finished()`` when
    its ``end_backward`` is done."""

    def __init__(self, probes: int = 2, settle: int = 1, recheck_every: int = 500,
                 clock: Callable[[], float] = time.perf_counter,
                 agree: Callable[[float, float], tuple[float, float]] | None = None) -> None:
        if probes < 1 or settle < 0 or recheck_every < 1:
            raise ValueError(f"AdaptiveOverlap(probes={probes}, settle={settle}, recheck_every={recheck_every}): "
                             "probes and recheck_every must be >= 1, settle >= 0")
        self.probes, self.settle, self.recheck_every = probes, settle, recheck_every
        self.clock = clock
        self.agree = agree
        """Combines this rank's two medians with the other ranks' (a sum over the group), so every rank keeps the
        same schedule; None on one process."""
        self.choice: bool | None = None
        """The schedule kept after the last probe (True: overlapped); None while the first probe runs."""
        self.decisions = 0
        self._count = 0  # reducing backwards in the current cycle (settle, probe, then keep)
        self._probe_from = settle  # the cycle's first probe (later cycles do not settle again)
        self._times: dict[bool, list[float]] = {True: [], False: []}
        self._started: float | None = None
        self._mode = True

    def next_overlap(self) -> bool:
        """The schedule for the reducing backward that starts now (starts its clock)."""
        k, probing_from = self._count, self._probe_from
        if k < probing_from:
            self._mode = True if self.choice is None else self.choice
        elif k < probing_from + 2 * self.probes:
            self._mode = (k - probing_from) % 2 == 0  # overlapped first, then after backward, in turn
        else:
            self._mode = bool(self.choice)
        self._started = self.clock()
        return self._mode

    def finished(self) -> None:
        """The reducing backward begun by the last ``next_overlap()`` is done: record its time, decide
        when the probe is complete, start the next probe after ``recheck_every`` kept ones."""
        if self._started is None:
            return
        elapsed = self.clock() - self._started
        self._started = None
        k, probing_from = self._count, self._probe_from
        self._count += 1
        if probing_from <= k < probing_from + 2 * self.probes:
            self._times[self._mode].append(elapsed)
            if k == probing_from + 2 * self.probes - 1:
                self._decide()
        elif k >= probing_from + 2 * self.probes + self.recheck_every - 1:
            self._count, self._probe_from = 0, 0  # probe again

    def _decide(self) -> None:
        overlapped, after = (statistics.median(self._times[m]) for m in (True, False))
        if self.agree is not None:
            overlapped, after = self.agree(overlapped, after)
        choice = overlapped <= after
        if choice != self.choice:
            logger.info("zero_optimization.overlap_comm unset: %s (median backward + reduction %.1f ms "
                        "overlapped, %.1f ms after backward)", "overlapping the gradient all-reduce with backward"
                        if choice else "reducing the gradients once backward is done", overlapped * 1e3, after * 1e3)
        self.choice = choice
        self.decisions += 1
        self._times = {True: [], False: []}
