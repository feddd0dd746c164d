"""What the engine measures about itself: step timers, throughput and the ``flops_profiler`` section.

The engine makes five calls (``on_forward``, ``time(name)``, ``after_step``, ``events``, ``print_lines``)
and this object does the rest, so the engine's training path stays about training.

The FLOPs profile covers one whole optimizer step, global step ``profile_step`` (counted from 0 as
DeepSpeed's ``global_steps``): every micro-step's forward and backward, measured, on rank 0. Its
fwd+bwd count then gives the TFLOP/s in every later throughput line.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Iterator

import torch

from deepshard.profiling.flops_profiler import FlopsProfiler
from deepshard.profiling.timers import TIMER_NAMES, MicroStepThroughputTimer, StepTimers, ThroughputTimer
from deepshard.utils.logging import logger

GB = 1024 ** 3


def count_tokens(inputs: Any, kwargs: dict[str, Any]) -> int:
    """Tokens in a micro-batch: the elements of ``input_ids`` or of the first integer tensor with two or more
    dimensions (batch x sequence); 0 when there is none (tokens/s is then not reported)."""
    ids = kwargs.get("input_ids")
    if torch.is_tensor(ids):
        return int(ids.numel())
    for value in list(inputs) + list(kwargs.values()):
        if torch.is_tensor(value) and value.dim() >= 2 and not value.is_floating_point() and value.dtype != torch.bool:
            return int(value.numel())
    return 0


def throughput_timer_config(timers: Any) -> SimpleNamespace:
    """The config's ``timers.throughput`` section (DeepSpeed's; both keys default to true)."""
    section = timers.get("throughput", {}) if isinstance(timers, dict) else {}
    return SimpleNamespace(enabled=bool(section.get("enabled", True)),
                           synchronized=bool(section.get("synchronized", True)))


class EngineTools:
    """Timers, throughput and the FLOPs profiler of one engine."""

    def __init__(self, config: Any, synchronize: Any, rank: int) -> None:
        self.breakdown = bool(config.wall_clock_breakdown)
        self.rank = rank
        self.profile_config = config.flops_profiler
        self.timers = StepTimers(synchronize if self.breakdown else None)
        self.throughput = ThroughputTimer(int(config.train_batch_size), synchronize)
        self.tput_timer = MicroStepThroughputTimer(throughput_timer_config(config.timers),
                                                   int(config.train_batch_size), synchronize=synchronize)
        """DeepSpeed's ``engine.tput_timer``: started at each forward, stopped at each ``step()``."""
        self.flops_profiler: FlopsProfiler | None = None
        self.flops_per_step: int | None = None
        self.profile_text: str | None = None
        self._step_times: dict[str, float] = dict.fromkeys(TIMER_NAMES, 0.0)
        self.last_step_times: dict[str, float] = dict.fromkeys(TIMER_NAMES, 0.0)
        self._tokens = 0
        self.tokens_per_step = 0

    # --------------------------------------------------------------------------- hooks
    def on_forward(self, engine: Any, inputs: Any, kwargs: dict[str, Any]) -> None:
        """Before the module's forward: start the step's clock, count tokens, maybe start profiling."""
        self.throughput.start()
        self.tput_timer.start()
        self._tokens += count_tokens(inputs, kwargs)
        cfg = self.profile_config
        if (cfg.enabled and self.rank == 0 and self.flops_profiler is None and self.flops_per_step is None
                and engine.global_steps == cfg.profile_step):
            self.flops_profiler = FlopsProfiler(engine.module, ds_engine=engine,
                                                recompute_fwd_factor=cfg.recompute_fwd_factor,
                                                peak_tflops=cfg.peak_tflops)
            self.flops_profiler.start_profile()

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Time a phase; inside the profiled step, backward and step times also go to the profile."""
        before = self.timers.micro[name]
        with self.timers.time(name):
            yield
        prof = self.flops_profiler
        if prof is not None and prof.started and name in ("backward", "step"):
            delta = self.timers.micro[name] - before
            if name == "backward":
                prof.backward_duration += delta
            else:
                prof.step_duration += delta

    def after_step(self, engine: Any, boundary: bool) -> None:
        """After ``engine.step()``: close the micro-step; at the boundary close the step and the profile."""
        self.tput_timer.stop(global_step=boundary)
        times = self.timers.end_micro_step()
        for name, value in times.items():
            self._step_times[name] += value
        if self.breakdown and self.rank == 0:
            logger.info(StepTimers.micro_line(times))
        if not boundary:
            return
        self.throughput.stop()
        self.last_step_times, self._step_times = self._step_times, dict.fromkeys(TIMER_NAMES, 0.0)
        self.tokens_per_step, self._tokens = self._tokens, 0
        if self.flops_profiler is not None and self.flops_profiler.started:
            self._finish_profile(engine)

    def _finish_profile(self, engine: Any) -> None:
        prof = self.flops_profiler
        if prof is None:
            return
        prof.stop_profile()
        prof.samples = engine.train_micro_batch_size_per_gpu() * engine.gradient_accumulation_steps()
        cfg = self.profile_config
        self.profile_text = prof.print_model_profile(profile_step=cfg.profile_step, module_depth=cfg.module_depth,
                                                     top_modules=cfg.top_modules, detailed=cfg.detailed,
                                                     output_file=cfg.output_file)
        self.flops_per_step = int(prof.get_total_flops()) + int(prof.get_total_backward_flops())
        prof.end_profile()

    # --------------------------------------------------------------------------- output
    def rates(self, dp_size: int) -> dict[str, float]:
        """The last step's samples/s (all processes), tokens/s (when known) and TFLOP/s per process (when
        the profile ran)."""
        t = self.throughput
        out = {"samples_per_sec": t.curr_samples_per_sec, "avg_samples_per_sec": t.avg_samples_per_sec}
        if self.tokens_per_step and t.last_step_time > 0:
            out["tokens_per_sec"] = self.tokens_per_step * dp_size / t.last_step_time
        if self.flops_per_step and t.last_step_time > 0:
            out["tflops"] = self.flops_per_step / t.last_step_time / 1e12
        return out

    def events(self, samples: int, dp_size: int) -> list[tuple[str, float, int]]:
        """Monitor events: throughput, and with ``wall_clock_breakdown`` the step's phase times (ms)."""
        events = [(f"Train/Samples/{key}", value, samples) for key, value in self.rates(dp_size).items()]
        if self.breakdown:
            events += [(f"Train/Samples/elapsed_time_ms_{n}", self.last_step_times[n] * 1e3, samples)
                       for n in TIMER_NAMES]
        return events

    def print_lines(self, dp_size: int, memory_allocated: int, max_memory_allocated: int,
                    memory_is_rss: bool = False) -> list[str]:
        """The ``steps_per_print`` lines: throughput (DeepSpeed's names), and the window's phase times.
        ``memory_is_rss``: the memory figures are the process's resident set (a CPU run), labelled
        ``ProcessRSS`` / ``MaxProcessRSS`` rather than the allocator's ``MemAllocated``."""
        r = self.rates(dp_size)
        now, peak = ("ProcessRSS", "MaxProcessRSS") if memory_is_rss else ("MemAllocated", "MaxMemAllocated")
        line = (f"RunningAvgSamplesPerSec={r['avg_samples_per_sec']:.3f}, "
                f"CurrSamplesPerSec={r['samples_per_sec']:.3f}, {now}={memory_allocated / GB:.2f}GB, "
                f"{peak}={max_memory_allocated / GB:.2f}GB")
        if "tokens_per_sec" in r:
            line += f", TokensPerSec={r['tokens_per_sec']:.1f}"
        if "tflops" in r:
            line += f", TFLOPsPerProcess={r['tflops']:.4g}"
        lines = [line]
        window = self.timers.take_window()
        if self.breakdown:
            lines.append(StepTimers.window_line(window))
        return lines
