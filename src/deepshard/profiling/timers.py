"""Step timers (``wall_clock_breakdown``) and the throughput timer (``steps_per_print``).

The names follow DeepSpeed's log and monitor events: per micro-step ``fwd_microstep``,
``bwd_microstep``, ``bwd_inner_microstep`` (autograd), ``bwd_allreduce_microstep`` (waiting for the
gradient reduction after autograd) and ``step_microstep``; per print window the sums ``fwd``, ``bwd``,
``bwd_inner``, ``bwd_allreduce`` and ``step``, sent to the monitors as
``Train/Samples/elapsed_time_ms_{forward,backward,backward_inner,backward_allreduce,step}``.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

TIMER_NAMES: tuple[str, ...] = ("forward", "backward", "backward_inner", "backward_allreduce", "step")
_SHORT = {"forward": "fwd", "backward": "bwd", "backward_inner": "bwd_inner",
          "backward_allreduce": "bwd_allreduce", "step": "step"}


class StepTimers:
    """Wall time per phase, for the current micro-step and summed over the print window.

    With ``synchronize`` the device is synchronized at each edge so the time is the device's, not the
    launch's (on by ``wall_clock_breakdown``; off, the timers still run, unsynchronized and cheap)."""

    def __init__(self, synchronize: Callable[[], None] | None = None) -> None:
        self._sync = synchronize
        self.micro: dict[str, float] = dict.fromkeys(TIMER_NAMES, 0.0)
        self.window: dict[str, float] = dict.fromkeys(TIMER_NAMES, 0.0)

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Add the block's wall time to ``name``."""
        if self._sync is not None:
            self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            self.micro[name] += time.perf_counter() - start

    def end_micro_step(self) -> dict[str, float]:
        """Close the micro-step: its times (seconds) move into the window and are returned."""
        done = dict(self.micro)
        for name, value in done.items():
            self.window[name] += value
        self.micro = dict.fromkeys(TIMER_NAMES, 0.0)
        return done

    def take_window(self) -> dict[str, float]:
        """The window's sums (seconds), and a fresh window."""
        done, self.window = self.window, dict.fromkeys(TIMER_NAMES, 0.0)
        return done

    @staticmethod
    def micro_line(times: dict[str, float]) -> str:
        """DeepSpeed's per-micro-step line: ``time (ms) | fwd_microstep: .. | bwd_microstep: ..``."""
        cells = " | ".join(f"{_SHORT[n]}_microstep: {times[n] * 1e3:.2f}" for n in TIMER_NAMES)
        return f"time (ms) | {cells}"

    @staticmethod
    def window_line(times: dict[str, float]) -> str:
        """DeepSpeed's per-window line: ``time (ms) | fwd: .. | bwd: .. | .. | step: ..``."""
        return "time (ms) | " + " | ".join(f"{_SHORT[n]}: {times[n] * 1e3:.2f}" for n in TIMER_NAMES)


class ThroughputTimer:
    """Samples/s over optimizer steps, timed from the first forward of a step to its boundary.

    The first ``skip`` steps (start-up, allocator warm-up) are left out of the running average, as
    DeepSpeed does; ``curr`` is the last step's rate."""

    def __init__(self, samples_per_step: int, synchronize: Callable[[], None], skip: int = 2) -> None:
        self.samples_per_step = samples_per_step
        self._sync = synchronize
        self.skip = skip
        self._start: float | None = None
        self.steps = 0
        self.total_time = 0.0
        self.total_samples = 0
        self.last_step_time = 0.0
        self._window = (0.0, 0)  # seconds and steps since the last print

    def start(self) -> None:
        """Mark the start of a step (no-op while a step is already being timed)."""
        if self._start is None:
            self._sync()
            self._start = time.perf_counter()

    def stop(self) -> None:
        """Mark the optimizer-step boundary."""
        if self._start is None:
            return
        self._sync()
        self.last_step_time = time.perf_counter() - self._start
        self._start = None
        self.steps += 1
        self._window = (self._window[0] + self.last_step_time, self._window[1] + 1)
        if self.steps > self.skip:
            self.total_time += self.last_step_time
            self.total_samples += self.samples_per_step

    def take_iter_time(self) -> float:
        """Mean seconds per step since the last call (DeepSpeed's ``iter time (s)``); starts a new window."""
        (seconds, steps), self._window = self._window, (0.0, 0)
        return seconds / steps if steps else 0.0

    @property
    def avg_samples_per_sec(self) -> float:
        return self.total_samples / self.total_time if self.total_time > 0 else 0.0

    @property
    def curr_samples_per_sec(self) -> float:
        return self.samples_per_step / self.last_step_time if self.last_step_time > 0 else 0.0


class MicroStepThroughputTimer:
    """DeepSpeed's ``engine.tput_timer`` (``deepspeed.utils.timer.ThroughputTimer``): its fields and counting,
    for code that reads them (DeepSpeed's own tests do).

    Each micro-step is timed from ``start()`` (the engine's forward) to ``stop()`` (the engine's step); the
    first ``start_step`` optimizer steps are not timed (``start_time`` stays 0), as DeepSpeed's warm-up.
    ``step_elapsed_time`` sums the micro-steps of the current optimizer step and is reset at its boundary
    (``stop(global_step=True)``); ``total_elapsed_time`` sums every timed micro-step. The engine's own
    throughput line comes from :class:`ThroughputTimer`; with ``steps_per_output`` this one also logs
    DeepSpeed's ``RunningAvgSamplesPerSec`` line at those global steps through ``logging_fn``."""

    def __init__(self, config: Any = None, batch_size: int | None = None, start_step: int = 2,
                 steps_per_output: int | None = None, monitor_memory: bool = False,
                 logging_fn: Callable[[str], Any] | None = None,
                 synchronize: Callable[[], None] | None = None) -> None:
        if monitor_memory:
            raise ValueError("ThroughputTimer(monitor_memory=True) is not provided by deepshard: its memory "
                             "figures are in the steps_per_print line; pass monitor_memory=False")
        self.config = config
        self.enabled = bool(getattr(config, "enabled", True))
        self.synchronized = bool(getattr(config, "synchronized", True))
        self._sync = synchronize
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logging_fn if logging_fn is not None else print
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False
        self.initialized = False
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0

    def _now(self) -> float:
        if self.synchronized and self._sync is not None:
            self._sync()
        return time.time()

    def update_epoch_count(self) -> None:
        """A new epoch: count it and restart the micro-step count."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """A micro-step begins (timed once ``start_step`` optimizer steps have passed)."""
        if not self.enabled:
            return
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = self._now()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """A micro-step ends; ``global_step``: it closed an optimizer step. No effect unless started."""
        if not self.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time <= 0:
            return
        self.end_time = self._now()
        duration = self.end_time - self.start_time
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if not global_step:
            return
        if report_speed and self.steps_per_output and self.global_step_count % self.steps_per_output == 0:
            self.logging(f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                         f"global_step={self.global_step_count}, RunningAvgSamplesPerSec="
                         f"{self.avg_samples_per_sec()}, CurrSamplesPerSec="
                         f"{self.batch_size / max(self.step_elapsed_time, 1e-8)}")
        self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed optimizer steps (-inf before any step)."""
        timed_steps = self.global_step_count - self.start_step
        if self.global_step_count <= 0:
            return float("-inf")
        if timed_steps <= 0 or self.total_elapsed_time <= 0:
            return 0.0
        return self.batch_size / (self.total_elapsed_time / timed_steps)
