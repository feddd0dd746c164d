"""``deepspeed.runtime.zero.stage_1_and_2`` under deepshard: DeepSpeed's documented import path for the
ZeRO-2 memory estimators (implemented in :mod:`deepshard.profiling.ds_estimators`), and the name of DeepSpeed's
ZeRO-1/2 optimizer (``engine.optimizer`` at stages 1 and 2: :mod:`deepshard.zero.zero_optimizer`)."""
from deepshard.compat.ds_optimizers import DeepSpeedZeroOptimizer
from deepshard.profiling.ds_estimators import (estimate_zero2_model_states_mem_needs,
                                               estimate_zero2_model_states_mem_needs_all_cold,
                                               estimate_zero2_model_states_mem_needs_all_live)

__all__ = ["DeepSpeedZeroOptimizer", "estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_cold",
           "estimate_zero2_model_states_mem_needs_all_live"]
