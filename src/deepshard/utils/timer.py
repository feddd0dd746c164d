"""``deepspeed.utils.timer``: the statistics helper DeepSpeed's communication logger uses (``trim_mean``) and
its ``ThroughputTimer`` (the class of ``engine.tput_timer``). DeepSpeed's timer registry
(``SynchronizedWallClockTimer``) is not provided: deepshard's engine times forward, backward and step itself
(turn on ``wall_clock_breakdown``)."""
from __future__ import annotations

from statistics import mean
from typing import Any, Sequence

from deepshard.profiling.timers import MicroStepThroughputTimer as ThroughputTimer

__all__ = ["ThroughputTimer", "trim_mean"]

_REGISTRY = ("DeepSpeed's timer registry (deepshard's engine times forward, backward, backward_inner, "
             "backward_allreduce and step; turn on wall_clock_breakdown) instead")


def trim_mean(data: Sequence[float], trim_percent: float) -> float:
    """The mean of ``data`` without its ``trim_percent`` smallest and largest values (0 for no data);
    ``data`` itself is left in its order."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_percent must be between 0 and 1, got {trim_percent}")
    if not data:
        return 0
    ordered = sorted(data)
    k = int(round(len(ordered) * trim_percent))
    return mean(ordered[k:len(ordered) - k])


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"deepspeed.utils.timer.{name} is not provided by deepshard: use {_REGISTRY}", name=name)
