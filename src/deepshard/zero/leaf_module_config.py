"""``deepspeed.runtime.zero.leaf_module_config``: the defaults of ``zero_optimization.leaf_module``, DeepSpeed
0.19.8's: the mixture-of-experts blocks of Hugging Face's Mixtral, Qwen2-MoE and Qwen3-MoE are ZeRO-3 leaves
unless the config says otherwise (their experts run in a data-dependent order). The section's model is
:class:`deepshard.config.zero.LeafModuleConfig` (``DeepSpeedZeroLeafModuleConfig``)."""
from __future__ import annotations

from deepshard.config.zero import (DEFAULT_LEAF_MODULE_CLASSES, DEFAULT_LEAF_MODULE_NAME_SUFFIXES,
                                   DEFAULT_LEAF_MODULE_NAMES, LeafModuleConfig)

DeepSpeedZeroLeafModuleConfig = LeafModuleConfig

__all__ = ["DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES", "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
           "DeepSpeedZeroLeafModuleConfig"]
