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
    "WARMUP_COSINE_LR", "WARMUP_LOG_RATE", "WARMUP_LINEAR_RATE", "add_tuning_arguments", "CONFIG_KEYS",
    "LR_SCHEDULE", "LR_RANGE_TEST_MIN_LR", "LR_RANGE_TEST_STEP_RATE", "LR_RANGE_TEST_STEP_SIZE",
    "LR_RANGE_TEST_STAIRCASE", "EDGE_VALUE", "MID_VALUE", "CYCLE_FIRST_STEP_SIZE", "CYCLE_FIRST_STAIR_COUNT",
    "CYCLE_SECOND_STEP_SIZE", "CYCLE_SECOND_STAIR_COUNT", "DECAY_STEP_SIZE", "CYCLE_MIN_LR", "CYCLE_MAX_LR",
    "DECAY_LR_RATE", "CYCLE_MIN_MOM", "CYCLE_MAX_MOM", "DECAY_MOM_RATE", "WARMUP_MIN_LR", "WARMUP_MAX_LR",
    "WARMUP_NUM_STEPS", "WARMUP_TYPE", "WARMUP_MIN_RATIO", "COS_MIN_RATIO", "TOTAL_NUM_STEPS",
]

# The config keys of the schedules' parameters, under DeepSpeed's constant names (``scheduler.params``).
LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"
WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"
CONFIG_KEYS: list[str] = [
    LR_SCHEDULE, LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE, LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE,
    EDGE_VALUE, MID_VALUE, CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT, CYCLE_SECOND_STEP_SIZE,
    CYCLE_SECOND_STAIR_COUNT, DECAY_STEP_SIZE, CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE, CYCLE_MIN_MOM,
    CYCLE_MAX_MOM, DECAY_MOM_RATE, WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE,
    WARMUP_MIN_RATIO, COS_MIN_RATIO, TOTAL_NUM_STEPS]
"""Every config-key constant above (what ``from deepspeed.runtime.lr_schedules import WARMUP_MIN_LR`` gets)."""

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
