"""``deepspeed.moe`` under deepshard: DeepSpeed's mixture-of-experts layer (:mod:`deepshard.moe.layer`), its
gate (:mod:`deepshard.moe.gate`), experts (:mod:`deepshard.moe.experts`), token dispatch
(:mod:`deepshard.moe.dispatch`) and the parameter-group helpers (:mod:`deepshard.moe.utils`)."""
from deepshard.moe import layer, utils

__all__ = ["layer", "utils"]
