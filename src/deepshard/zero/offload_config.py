"""``deepspeed.runtime.zero.offload_config``: the offload sections of ``zero_optimization`` under DeepSpeed's
class names (deepshard's own models, :mod:`deepshard.config.zero`) and DeepSpeed's two enums: where states
are offloaded to, and which states ``engine.offload_states()`` moves."""
from __future__ import annotations

from enum import Enum

from deepshard.config.zero import OffloadOptimizerConfig, OffloadParamConfig

DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig

__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum",
           "OffloadStateTypeEnum"]


class OffloadDeviceEnum(str, Enum):
    """An offload target (compares equal to the config's strings: ``OffloadDeviceEnum.cpu == "cpu"``)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """A kind of training state: optimizer states, fp32 master parameters, 16-bit parameters, 16-bit
    gradients, the contiguous gradient buffer."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"
