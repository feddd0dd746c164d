"""``deepspeed.module_inject`` under deepshard: only AutoEP's replaced layer,
``deepspeed.module_inject.auto_ep_layer.AutoEPMoELayer`` (:mod:`deepshard.moe.autoep_layer`), which code
finds AutoEP's MoE blocks with. The rest of DeepSpeed's package is kernel injection for inference
(``replace_transformer_layer``, its policies and layers, AutoTP's injection helpers), which deepshard does not
implement: importing those names raises an error saying so."""
from __future__ import annotations

from typing import Any

from deepshard.compat.aliases import missing_attribute


def __getattr__(name: str) -> Any:
    raise missing_attribute("deepspeed.module_inject", name)
