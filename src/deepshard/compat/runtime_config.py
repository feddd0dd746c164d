"""``deepspeed.runtime.config`` under deepshard: the config class under DeepSpeed's names
(``DeepSpeedConfig``, :mod:`deepshard.runtime.ds_config`; ``DeepSpeedConfigError``), DeepSpeed's
optimizer-name constants and ``get_*`` readers of a config dict, and every other name of
:mod:`deepshard.config`."""
from __future__ import annotations

from typing import Any

import deepshard.config as _config
from deepshard.config import ConfigError
from deepshard.runtime import constants as _constants
from deepshard.runtime.ds_config import DeepSpeedConfig

DeepSpeedConfigError = ConfigError

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
DEEPSPEED_OPTIMIZERS: list[str] = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER,
                                   MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER, LION_OPTIMIZER,
                                   MUON_OPTIMIZER]
"""The optimizer ``type`` names (lower-cased) DeepSpeed 0.19.8 builds itself (its 1-bit optimizers' names
are gone from this module); deepshard's optimizer factory answers each one it implements and refuses the
others by name (:mod:`deepshard.optim.factory`)."""
TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True
TENSOR_CORE_ALIGN_SIZE = 8


def get_gradient_clipping(param_dict: dict[str, Any]) -> float:
    """``gradient_clipping`` of a config dict, or its default (1.0)."""
    return param_dict.get(_constants.GRADIENT_CLIPPING, _constants.GRADIENT_CLIPPING_DEFAULT)


def get_log_level(param_dict: dict[str, Any]) -> Any:
    """``log_level`` of a config dict, or its default (None: leave the logger's level alone)."""
    return param_dict.get(_constants.LOG_LEVEL, _constants.LOG_LEVEL_DEFAULT)


def get_train_batch_size(param_dict: dict[str, Any]) -> Any:
    return param_dict.get(_constants.TRAIN_BATCH_SIZE, _constants.TRAIN_BATCH_SIZE_DEFAULT)


def get_train_micro_batch_size_per_gpu(param_dict: dict[str, Any]) -> Any:
    return param_dict.get(_constants.TRAIN_MICRO_BATCH_SIZE_PER_GPU,
                          _constants.TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT)


def get_gradient_accumulation_steps(param_dict: dict[str, Any]) -> Any:
    return param_dict.get(_constants.GRADIENT_ACCUMULATION_STEPS, _constants.GRADIENT_ACCUMULATION_STEPS_DEFAULT)


def get_zero_config(param_dict: dict[str, Any]) -> Any:
    """The ``zero_optimization`` section of a config dict as deepshard's ZeRO config model."""
    from deepshard.config.zero import ZeroConfig

    section = param_dict.get(_constants.ZERO_OPTIMIZATION, {})
    if isinstance(section, bool):
        section = {"stage": int(section)}
    return ZeroConfig(**section)


def __getattr__(name: str) -> Any:
    if hasattr(_constants, name):
        return getattr(_constants, name)
    return getattr(_config, name)
