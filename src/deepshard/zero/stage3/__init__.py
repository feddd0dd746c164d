"""ZeRO stage 3: partitioned parameters gathered just in time."""
from deepshard.zero.stage3.gather import GatheredParameters
from deepshard.zero.stage3.generation import unwrap_model_for_generation
from deepshard.zero.stage3.init import Init

__all__ = ["GatheredParameters", "Init", "unwrap_model_for_generation"]
