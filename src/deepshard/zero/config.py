"""``deepspeed.runtime.zero.config``: the ``zero_optimization`` section under DeepSpeed's class name
(``DeepSpeedZeroConfig`` is deepshard's own model, :class:`deepshard.config.zero.ZeroConfig`: the same
keys, ``stage3_*`` aliases, deprecated spellings and defaults but ``stage3_max_reuse_distance``, 0 here),
its offload sections, and DeepSpeed's ``ZeroStageEnum``."""
from __future__ import annotations

from enum import Enum

from deepshard.config.zero import ZeroConfig
from deepshard.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig,
                                           OffloadDeviceEnum)

DeepSpeedZeroConfig = ZeroConfig

__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig",
           "OffloadDeviceEnum", "ZeroStageEnum"]


class ZeroStageEnum(int, Enum):
    """The ZeRO stages by what they partition (an int: ``ZeroStageEnum.weights == 3``)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3
