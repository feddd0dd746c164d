"""Optimizers and learning-rate schedules that a DeepSpeed config can name.

``build_optimizer`` / ``build_scheduler`` turn the config's ``{"type", "params"}`` sections into
objects; :class:`Lamb` and :class:`Lion` are deepshard's own implementations; the schedules are
DeepSpeed's (same names, parameters and formulas).
"""
from deepshard.optim.factory import DEEPSPEED_OPTIMIZERS, build_optimizer, build_scheduler
from deepshard.optim.lamb import Lamb
from deepshard.optim.lion import Lion
from deepshard.optim.lr_schedules import (VALID_LR_SCHEDULES, LRRangeTest, LRSchedulerLike,
                                          OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR)

__all__ = [
    "build_optimizer", "build_scheduler", "DEEPSPEED_OPTIMIZERS", "Lamb", "Lion",
    "LRSchedulerLike", "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
    "VALID_LR_SCHEDULES",
]
