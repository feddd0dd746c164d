"""``deepspeed.moe`` under deepshard: the parameter-group helpers for models without expert layers
(:mod:`deepshard.moe.utils`), and DeepSpeed's ``MoE`` layer refused with the reason
(:mod:`deepshard.moe.layer`). deepshard has no mixture-of-experts layers or expert parallelism."""
from deepshard.moe import layer, utils

__all__ = ["layer", "utils"]
