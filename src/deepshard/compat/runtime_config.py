"""``deepspeed.runtime.config`` under deepshard: the config class under DeepSpeed's names
(``DeepSpeedConfig``, ``DeepSpeedConfigError``), DeepSpeed's optimizer-name constants, and every other
name of :mod:`deepshard.config`."""
from __future__ import annotations

from typing import Any

import deepshard.config as _config
from deepshard.config import ConfigError, DeepShardConfig

DeepSpeedConfig = DeepShardConfig
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


def __getattr__(name: str) -> Any:
    return getattr(_config, name)
