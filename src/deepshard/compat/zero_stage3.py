"""``deepspeed.runtime.zero.stage3`` under deepshard: DeepSpeed's documented import path for the ZeRO-3
memory estimators (implemented in :mod:`deepshard.profiling.ds_estimators`), and the names of
:mod:`deepshard.zero.stage3`."""
from __future__ import annotations

from typing import Any

import deepshard.zero.stage3 as _stage3
from deepshard.compat.ds_optimizers import DeepSpeedZeroOptimizer_Stage3
from deepshard.profiling.ds_estimators import (estimate_zero3_model_states_mem_needs,
                                               estimate_zero3_model_states_mem_needs_all_cold,
                                               estimate_zero3_model_states_mem_needs_all_live)

__all__ = ["DeepSpeedZeroOptimizer_Stage3", "estimate_zero3_model_states_mem_needs", "estimate_zero3_model_states_mem_needs_all_cold",
           "estimate_zero3_model_states_mem_needs_all_live"]


def __getattr__(name: str) -> Any:
    return getattr(_stage3, name)
