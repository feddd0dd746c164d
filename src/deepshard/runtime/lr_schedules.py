"""``deepspeed.runtime.lr_schedules`` under deepshard: the same names, from :mod:`deepshard.optim`.

Code that does ``from deepspeed.runtime.lr_schedules import WarmupLR, VALID_LR_SCHEDULES`` works
with ``import deepshard as deepspeed``. ``add_tuning_arguments`` adds DeepSpeed's
"Convergence Tuning" command-line flags (the schedule parameters) to an argparse parser.
"""
from __future__ import annotations

import argparse

from deepshard.optim.lr_schedules import (LR_RANGE_TEST, ONE_CYCLE, VALID_LR_SCHEDULES,
                                          WARMUP_COSINE_LR, WARMUP_DECAY_LR, WARMUP_LINEAR_RATE,
                                          WARMUP_LOG_RATE, WARMUP_LR, LRRangeTest,
                                          LRSchedulerLike, OneCycle, WarmupCosineLR,
                                          WarmupDecayLR, WarmupLR)

__all__ = [
    "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "LRSchedulerLike",
    "VALID_LR_SCHEDULES", "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR",
    "WARMUP_COSINE_LR", "WARMUP_LOG_RATE", "WARMUP_LINEAR_RATE", "add_tuning_arguments",
]

# (flag, type, default, help) of DeepSpeed's tuning flags; the defaults are its parser's.
_TUNING_FLAGS: list[tuple[str, type, object, str]] = [
    ("lr_schedule", str, None, "LR schedule for training (one of VALID_LR_SCHEDULES)."),
    ("lr_range_test_min_lr", float, 0.001, "Starting lr of the LR range test."),
    ("lr_range_test_step_rate", float, 1.0, "Scaling rate of the LR range test."),
    ("lr_range_test_step_size", int, 1000, "Training steps per LR range test increase."),
    ("lr_range_test_staircase", bool, False, "Staircase (not continuous) LR range test."),
    ("cycle_first_step_size", int, 1000, "Steps of the first half of the 1Cycle schedule."),
    ("cycle_first_stair_count", int, -1, "Stairs in the first half of the 1Cycle schedule."),
    ("cycle_second_step_size", int, -1, "Steps of the second half (default: the first's)."),
    ("cycle_second_stair_count", int, -1, "Stairs in the second half of the 1Cycle schedule."),
    ("decay_step_size", int, 1000, "Steps per post-cycle decay interval."),
    ("cycle_min_lr", float, 0.01, "1Cycle lr lower bound."),
    ("cycle_max_lr", float, 0.1, "1Cycle lr upper bound."),
    ("decay_lr_rate", float, 0.0, "Post-cycle lr decay rate."),
    ("cycle_min_mom", float, 0.8, "1Cycle momentum lower bound."),
    ("cycle_max_mom", float, 0.9, "1Cycle momentum upper bound."),
    ("decay_mom_rate", float, 0.0, "Post-cycle momentum decay rate."),
    ("warmup_min_lr", float, 0.0, "WarmupLR minimum (initial) lr."),
    ("warmup_max_lr", float, 0.001, "WarmupLR maximum lr."),
    ("warmup_num_steps", int, 1000, "WarmupLR warmup steps."),
    ("warmup_type", str, WARMUP_LOG_RATE, "WarmupLR warmup function: log or linear."),
    ("warmup_min_ratio", float, 0.01, "WarmupCosineLR initial lr ratio."),
    ("cos_min_ratio", float, 0.01, "WarmupCosineLR final lr ratio."),
]


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's "Convergence Tuning" flags (``--lr_schedule``, ``--warmup_num_steps``
    ...) to ``parser`` and return it, as ``deepspeed.add_tuning_arguments`` does."""
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    for name, kind, default, text in _TUNING_FLAGS:
        group.add_argument(f"--{name}", type=kind, default=default, help=text)
    group.add_argument("--cycle_momentum", default=False, action="store_true",
                       help="Enable the 1Cycle momentum schedule.")
    return parser
