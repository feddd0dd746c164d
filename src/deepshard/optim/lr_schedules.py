"""Per-batch learning-rate schedules with DeepSpeed's names, parameters and formulas.

Every schedule counts optimizer steps in ``last_batch_iteration`` (``-1`` = not started). The
constructor writes the schedule's value at ``last_batch_iteration`` into the optimizer, and each
``step()`` advances the counter by one and writes the next value; so the first training step runs
with the value at ``-1`` (for the warmups: the minimum lr, or 0 for WarmupCosineLR) and, after
``k`` calls to ``step()``, the optimizer holds the value at ``k - 1``. This is DeepSpeed's order.

With ``t = last_batch_iteration`` and ``W = max(2, warmup_num_steps)``:

- warmup fraction ``gamma(t)``: ``log(t + 1) / log(W)`` ("log") or ``t / W`` ("linear") for
  ``t < W``, then 1.
- ``WarmupLR``: ``min_lr + (max_lr - min_lr) * gamma(t)``.
- ``WarmupDecayLR``: as WarmupLR during warmup, then ``gamma = max(0, (T - t) / max(1, T - W))``
  with ``T = total_num_steps``: a linear decay that reaches ``min_lr`` at ``t = T``.
- ``WarmupCosineLR``: ``lr = base_lr * ratio`` with ``ratio = r0 + (1 - r0) * gamma(t)`` during
  warmup (``r0 = warmup_min_ratio``), then ``c + (1 - c) * (1 + cos(pi * p)) / 2`` with
  ``p = min(1, (t - W + 1) / max(1, T - W))``, ``c = cos_min_ratio``.
- ``OneCycle``: Smith 2018 (arXiv:1803.09820). With ``i = t + 1`` iterations into a cycle of
  ``first + second`` steps, the scale rises ``i / first`` then falls ``(total - i) / second``;
  ``lr = min_lr + (max_lr - min_lr) * scale`` and momentum ``max_mom - (max_mom - min_mom) *
  scale``. Stair counts quantise the scale to ``floor(scale * stairs) / stairs``. After the cycle
  (``t >= total``), with ``d = t - total + 1``: ``lr = min_lr / (1 + decay_lr_rate * d /
  decay_step_size)`` and ``mom = max_mom * (1 + decay_mom_rate * d / decay_step_size)`` (no decay
  when the rate or ``decay_step_size`` is 0).
- ``LRRangeTest``: ``min_lr * (1 + step_rate * (t + 1) / step_size)``, with ``floor`` of the
  interval when ``lr_range_test_staircase``.

As in DeepSpeed: an unknown ``warmup_type`` warms up with "log" (with a warning); OneCycle cycles only
Adam-style ``betas``, writing ``(beta1, 0.99)`` (``get_mom()`` returns those pairs), starts the first
step at ``(cycle_min_mom, 0.99)``, and accepts ``cycle_second_step_size=0`` (a cycle that only rises).
Where deepshard differs on purpose (documented at each class): WarmupLR's default ``warmup_max_lr`` is
each group's own lr (DeepSpeed copies the first group's to all groups); ``load_state_dict`` also writes
the resumed lr into the optimizer.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from deepshard.utils.logging import logger

__all__ = [
    "LRSchedulerLike", "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
    "VALID_LR_SCHEDULES", "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR",
    "WARMUP_COSINE_LR", "WARMUP_LOG_RATE", "WARMUP_LINEAR_RATE",
]

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES: list[str] = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR,
                                 WARMUP_COSINE_LR]
WARMUP_LOG_RATE = "log"
ONE_CYCLE_BETA2 = 0.99
"""The beta2 OneCycle writes with each cycled beta1, whatever the optimizer had (DeepSpeed's value)."""
WARMUP_LINEAR_RATE = "linear"
_WARMUP_TYPES = (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE)


@runtime_checkable
class LRSchedulerLike(Protocol):
    """What the engine needs from a scheduler: ours and ``torch.optim.lr_scheduler``'s."""

    def step(self, *args: Any, **kwargs: Any) -> Any: ...

    def get_last_lr(self) -> list[float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _param_groups(optimizer: Any, schedule: str) -> list[dict[str, Any]]:
    """The optimizer's param_groups, or a TypeError that says what was passed."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not groups:
        raise TypeError(f"{schedule} needs an optimizer with a non-empty param_groups list "
                        f"(a torch.optim.Optimizer); got {type(optimizer).__name__}")
    return groups


def _per_group(value: Any, n_groups: int, name: str) -> list[float]:
    """One float per parameter group from a number or a list/tuple of ``n_groups`` numbers."""
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise ValueError(f"{name} has {len(value)} values but the optimizer has {n_groups} "
                             "parameter groups; give one number, or one per group")
        return [float(v) for v in value]
    return [float(value)] * n_groups


def _set_group_lrs(groups: list[dict[str, Any]], lrs: list[float]) -> list[float]:
    """Write ``lrs`` into the groups (in place for tensor lrs); return them."""
    for group, lr in zip(groups, lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return list(lrs)


def _check_int(name: str, value: Any, minimum: int, schedule: str) -> int:
    """``value`` as an int >= ``minimum``, or a ValueError naming the parameter."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{schedule}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_warmup(warmup_num_steps: Any, schedule: str) -> int:
    """Validate the warmup step count; return the effective count ``max(2, steps)``."""
    _check_int("warmup_num_steps", warmup_num_steps, 1, schedule)
    # log(1) = 0 would divide by zero, so (like DeepSpeed) a warmup lasts at least 2 steps.
    return max(2, warmup_num_steps)


def _warmup_kind(warmup_type: Any, schedule: str) -> str:
    """``warmup_type`` if known, else "log" with a warning (DeepSpeed's fallback)."""
    if warmup_type in _WARMUP_TYPES:
        return str(warmup_type)
    logger.warning("%s: unknown warmup_type %r; warming up with '%s' (DeepSpeed's default). Use '%s' or '%s'",
                   schedule, warmup_type, WARMUP_LOG_RATE, WARMUP_LOG_RATE, WARMUP_LINEAR_RATE)
    return WARMUP_LOG_RATE


def _warmup_fraction(t: int, warmup_steps: int, warmup_type: str) -> float:
    """How far the warmup is at iteration ``t < warmup_steps``: 0 at t=0, towards 1."""
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(t + 1) / math.log(warmup_steps)
    return t / warmup_steps


def _check_total(total_num_steps: Any, warmup_num_steps: int, schedule: str) -> int:
    """Validate ``total_num_steps``; warn (as DeepSpeed does) when it is inside the warmup."""
    _check_int("total_num_steps", total_num_steps, 1, schedule)
    if total_num_steps < warmup_num_steps:
        logger.warning("%s: total_num_steps (%d) is less than warmup_num_steps (%d); the "
                       "schedule ends during warmup and then stays at its final value",
                       schedule, total_num_steps, warmup_num_steps)
    return total_num_steps


class _BatchSchedule:
    """Shared mechanics: the iteration counter, writing lrs, get_last_lr, state_dict."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = optimizer
        _param_groups(optimizer, type(self).__name__)
        self.last_batch_iteration = _check_int("last_batch_iteration", last_batch_iteration, -1,
                                               type(self).__name__)
        self._last_lr: list[float] = []

    def get_lr(self) -> list[float]:
        """The lr of each parameter group at ``last_batch_iteration``."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The lrs last written into the optimizer, one per parameter group."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the next one) and write its lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        """``{'last_batch_iteration': n}``, as DeepSpeed saves it."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the saved iteration and write its lrs into the optimizer."""
        if "last_batch_iteration" not in state_dict:
            raise KeyError(f"{type(self).__name__}.load_state_dict: the state has no "
                           f"'last_batch_iteration' (keys: {sorted(state_dict)})")
        self.last_batch_iteration = state_dict["last_batch_iteration"]
        self._apply()

    def _apply(self) -> None:
        """Write the schedule's values at the current iteration into the optimizer."""
        self._last_lr = _set_group_lrs(self.optimizer.param_groups, self.get_lr())


class LRRangeTest(_BatchSchedule):
    """Learning-rate range test: grow the lr from ``lr_range_test_min_lr`` without bound.

    Smith 2018 (arXiv:1803.09820): train while the lr grows and find where the loss diverges;
    that bounds the lrs of a cyclic schedule. ``lr = min_lr * (1 + step_rate * interval)`` with
    ``interval = (t + 1) / step_size`` (``floor`` of it when ``lr_range_test_staircase``).

    Args:
        optimizer: the wrapped optimizer.
        lr_range_test_min_lr: starting lr (a number or one per parameter group).
        lr_range_test_step_size: iterations per unit of interval.
        lr_range_test_step_rate: growth per interval.
        lr_range_test_staircase: grow in steps instead of continuously.
        last_batch_iteration: the index of the last batch (-1: start from the beginning).
    """

    def __init__(self, optimizer: Any, lr_range_test_min_lr: float | list[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        n_groups = len(optimizer.param_groups)
        self.min_lr = _per_group(lr_range_test_min_lr, n_groups, "lr_range_test_min_lr")
        if not lr_range_test_step_size or lr_range_test_step_size <= 0:
            raise ValueError(f"LRRangeTest: lr_range_test_step_size must be > 0, got "
                             f"{lr_range_test_step_size!r}")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = bool(lr_range_test_staircase)
        self._apply()

    def step(self, batch_iteration: int | None = None) -> None:
        """Advance to ``batch_iteration`` (default: the next one) and write its values.

        The keyword is ``batch_iteration`` here, as in DeepSpeed's LRRangeTest.
        """
        super().step(batch_iteration)

    @property
    def interval_fn(self) -> Callable[[], float]:
        """DeepSpeed's name for the function giving the current interval (continuous or staircase)."""
        return self._interval

    def _interval(self) -> float:
        """Iterations done, in units of ``step_size`` (whole units for the staircase)."""
        interval = (self.last_batch_iteration + 1) / self.step_size
        return float(math.floor(interval)) if self.staircase else interval

    def get_lr(self) -> list[float]:
        """``min_lr * (1 + step_rate * interval)`` for each group."""
        increase = 1.0 + self.step_rate * self._interval()
        return [lr * increase for lr in self.min_lr]


class WarmupLR(_BatchSchedule):
    """Warm the lr up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    Args:
        optimizer: the wrapped optimizer.
        warmup_min_lr: lr at the start (a number or one per parameter group).
        warmup_max_lr: lr at the end of the warmup; None (default) takes each group's current lr.
            DeepSpeed copies the first group's lr to every group; deepshard keeps each group's.
        warmup_num_steps: warmup length in optimizer steps (at least 2 are used).
        warmup_type: "log" (fast start) or "linear".
        last_batch_iteration: the index of the last batch (-1: start from the beginning).
    """

    def __init__(self, optimizer: Any, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        groups = optimizer.param_groups
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in groups]
        self.min_lrs = _per_group(warmup_min_lr, len(groups), "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, len(groups), "warmup_max_lr")
        self.delta_lrs = [hi - lo for lo, hi in zip(self.min_lrs, self.max_lrs)]
        self.warmup_num_steps = _check_warmup(warmup_num_steps, type(self).__name__)
        self.warmup_type = _warmup_kind(warmup_type, type(self).__name__)
        self._validate_extra(warmup_num_steps)
        self._apply()

    @property
    def inverse_log_warm_up(self) -> float:
        """``1 / ln(warmup_num_steps)``, the log warmup's normaliser (DeepSpeed's attribute)."""
        return 1.0 / math.log(self.warmup_num_steps)

    def _validate_extra(self, warmup_num_steps: int) -> None:
        """Hook for subclasses to check their own arguments before the first lr is written."""

    def _gamma(self) -> float:
        """Fraction of ``max_lr - min_lr`` added to ``min_lr`` at the current iteration."""
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps,
                                    self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        """``min_lr + (max_lr - min_lr) * gamma`` for each group (``min_lr`` before the start)."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay that reaches ``warmup_min_lr`` at ``total_num_steps``.

    Args:
        optimizer: the wrapped optimizer.
        total_num_steps: total optimizer steps of the run.
        warmup_min_lr: lr at the start and at the end (a number or one per group).
        warmup_max_lr: peak lr, reached when the warmup ends (default 0.001, as in DeepSpeed).
        warmup_num_steps: warmup length in optimizer steps (at least 2 are used).
        warmup_type: "log" or "linear".
        last_batch_iteration: the index of the last batch (-1: start from the beginning).
    """

    def __init__(self, optimizer: Any, total_num_steps: int,
                 warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _validate_extra(self, warmup_num_steps: int) -> None:
        _check_total(self.total_num_steps, warmup_num_steps, type(self).__name__)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_BatchSchedule):
    """Warm up to each group's lr, then a cosine decay to ``cos_min_ratio`` times it.

    The lrs are ratios of the optimizer's lrs when the schedule is built (``base_lrs``).

    Args:
        optimizer: the wrapped optimizer; its lrs are the peak lrs.
        total_num_steps: total optimizer steps of the run (the cosine ends at step T - 1).
        warmup_min_ratio: lr ratio at the start of the warmup.
        warmup_num_steps: warmup length in optimizer steps (at least 2 are used).
        cos_min_ratio: lr ratio at the end of the cosine, and after it.
        warmup_type: "log" or "linear".
        last_batch_iteration: the index of the last batch (-1: start from the beginning).
    """

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_num_steps = _check_warmup(warmup_num_steps, "WarmupCosineLR")
        self.warmup_type = _warmup_kind(warmup_type, "WarmupCosineLR")
        self.total_num_steps = _check_total(total_num_steps, warmup_num_steps, "WarmupCosineLR")
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self._apply()

    @property
    def org_lrs(self) -> list[float]:
        """DeepSpeed's name for ``base_lrs``: the optimizer's lrs when the schedule was built."""
        return self.base_lrs

    @property
    def inverse_log_warm_up(self) -> float:
        """``1 / ln(warmup_num_steps)``, the log warmup's normaliser (DeepSpeed's attribute)."""
        return 1.0 / math.log(self.warmup_num_steps)

    def get_lr_ratio(self) -> float:
        """The factor applied to every base lr at the current iteration."""
        t = self.last_batch_iteration
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            fraction = _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * fraction
        done = t - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        """``base_lr * ratio`` for each group."""
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.base_lrs]


class OneCycle(_BatchSchedule):
    """1Cycle: lr up then down (momentum down then up) over one cycle, then an optional decay.

    Smith 2018, "A disciplined approach to neural network hyper-parameters: Part 1"
    (arXiv:1803.09820). Formulas in the module docstring.

    Momentum cycling writes ``betas = (beta1, 0.99)`` for Adam-like optimizers (``betas`` in the
    defaults), as DeepSpeed does; for others it is disabled with a warning. Before the first
    ``step()`` the groups hold ``(cycle_min_mom, 0.99)`` while ``get_mom()`` already answers the
    formula's ``cycle_max_mom`` (DeepSpeed's order).

    Args:
        optimizer: the wrapped optimizer.
        cycle_min_lr: lr at both ends of the cycle (a number or one per parameter group).
        cycle_max_lr: lr at the peak of the cycle (a number or one per group).
        decay_lr_rate: post-cycle lr decay rate (0: hold ``cycle_min_lr``).
        cycle_first_step_size: iterations of the rising half.
        cycle_second_step_size: iterations of the falling half (None: same as the first; 0: none).
        cycle_first_stair_count: stairs in the rising half (0 or less: continuous).
        cycle_second_stair_count: stairs in the falling half (None: same as the first).
        decay_step_size: iterations per decay interval after the cycle (0: no decay).
        cycle_momentum: cycle the momentum inversely to the lr.
        cycle_min_mom: momentum at the peak lr (a number or one per group).
        cycle_max_mom: momentum at the ends of the cycle (a number or one per group).
        decay_mom_rate: post-cycle momentum growth rate (0: hold ``cycle_max_mom``).
        last_batch_iteration: the index of the last batch (-1: start from the beginning).
    """

    def __init__(self, optimizer: Any, cycle_min_lr: float | list[float],
                 cycle_max_lr: float | list[float], decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True,
                 cycle_min_mom: float | list[float] = 0.8,
                 cycle_max_mom: float | list[float] = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self._init_shape(cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count,
                         cycle_second_stair_count, decay_step_size)
        n_groups = len(optimizer.param_groups)
        self.min_lrs = _per_group(cycle_min_lr, n_groups, "cycle_min_lr")
        self.max_lrs = _per_group(cycle_max_lr, n_groups, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.min_moms = _per_group(cycle_min_mom, n_groups, "cycle_min_mom")
        self.max_moms = _per_group(cycle_max_mom, n_groups, "cycle_max_mom")
        self.decay_mom_rate = float(decay_mom_rate)
        self.cycle_momentum = bool(cycle_momentum) and self._has_betas(optimizer)
        self._apply()
        if self.cycle_momentum and last_batch_iteration == -1:
            # DeepSpeed's start: the first optimizer step runs with (cycle_min_mom, 0.99)
            for group, mom in zip(self.optimizer.param_groups, self.min_moms):
                group["betas"] = (mom, ONE_CYCLE_BETA2)

    def step(self, batch_iteration: int | None = None) -> None:
        """Advance to ``batch_iteration`` (default: the next one) and write its values.

        The keyword is ``batch_iteration`` here, as in DeepSpeed's OneCycle.
        """
        super().step(batch_iteration)

    def _init_shape(self, first: int, second: int | None, first_stairs: int,
                    second_stairs: int | None, decay_step_size: int) -> None:
        """Validate and store the cycle's half lengths, stair counts and decay interval."""
        second = first if second is None else second
        second_stairs = first_stairs if second_stairs is None else second_stairs
        if first <= 0:
            raise ValueError(f"OneCycle: cycle_first_step_size must be > 0, got {first!r}")
        if second < 0:  # 0: the cycle only rises, then restarts (DeepSpeed accepts it too)
            raise ValueError(f"OneCycle: cycle_second_step_size must be >= 0, got {second!r}")
        if decay_step_size < 0:
            raise ValueError(f"OneCycle: decay_step_size must be >= 0 (0 disables the post-cycle "
                             f"decay), got {decay_step_size!r}")
        self.first_step_size = float(first)
        self.second_step_size = float(second)
        self.total_size = self.first_step_size + self.second_step_size
        self.first_stair_count = int(first_stairs)
        self.second_stair_count = int(second_stairs)
        self.decay_step_size = decay_step_size

    @property
    def step_ratio(self) -> float:
        """The rising half's share of the cycle (1.0 when the cycle only rises)."""
        return self.first_step_size / self.total_size

    @property
    def skip_lr_decay(self) -> bool:
        """True when the lr holds ``cycle_min_lr`` after the cycle (no decay interval or a zero rate)."""
        return self.decay_step_size == 0 or self.decay_lr_rate == 0.0

    @property
    def skip_mom_decay(self) -> bool:
        """True when the momentum holds ``cycle_max_mom`` after the cycle."""
        return self.decay_step_size == 0 or self.decay_mom_rate == 0.0

    @staticmethod
    def _has_betas(optimizer: Any) -> bool:
        """Whether the optimizer has Adam-style ``betas`` to cycle (DeepSpeed cycles nothing else)."""
        defaults = getattr(optimizer, "defaults", None) or optimizer.param_groups[0]
        if "betas" in defaults:
            return True
        logger.warning("OneCycle: cycle_momentum is disabled because %s has no 'betas' (as in DeepSpeed, only "
                       "Adam-style beta1 is cycled); set cycle_momentum to false to silence this",
                       type(optimizer).__name__)
        return False

    def _scale(self) -> float:
        """Position in the cycle as a fraction of the lr range (0 at the ends, 1 at the peak)."""
        iteration = self.last_batch_iteration + 1
        position = iteration - self.total_size * math.floor(iteration / self.total_size)
        if position <= self.first_step_size:
            stairs, done, size = self.first_stair_count, position, self.first_step_size
        else:
            stairs, done, size = (self.second_stair_count, self.total_size - position,
                                  self.second_step_size)
        if stairs > 0:
            # Quantise from the iteration count, not from done / size, so that an exact stair
            # boundary is not floored one stair down by round-off.
            return math.floor(done * stairs / size) / stairs
        return done / size

    def _decay_intervals(self) -> float:
        """Decay intervals elapsed after the cycle (0 when decay is off)."""
        if self.decay_step_size == 0:
            return 0.0
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        """The lr of each group at the current iteration."""
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        factor = 1.0 + self.decay_lr_rate * self._decay_intervals()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """Each group's ``betas`` at the current iteration: (the cycled beta1, 0.99), DeepSpeed's pair;
        None if momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            moms = [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        else:
            factor = 1.0 + self.decay_mom_rate * self._decay_intervals()
            moms = [hi * factor for hi in self.max_moms]
        return [(mom, ONE_CYCLE_BETA2) for mom in moms]

    def _apply(self) -> None:
        super()._apply()
        for group, betas in zip(self.optimizer.param_groups, self.get_mom() or []):
            group["betas"] = betas
