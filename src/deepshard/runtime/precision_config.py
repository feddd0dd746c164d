"""``deepspeed.runtime.precision_config``: the ``fp16`` and ``bf16`` sections under DeepSpeed's class names
(they are deepshard's own section models, :mod:`deepshard.config.precision`) and DeepSpeed's readers of a
config dict."""
from __future__ import annotations

from typing import Any

from deepshard.config.precision import BF16Config, FP16Config

DeepSpeedFP16Config = FP16Config
DeepSpeedBF16Config = BF16Config

FP16 = "fp16"
BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"

__all__ = ["BFLOAT16", "BFLOAT16_OLD", "DeepSpeedBF16Config", "DeepSpeedFP16Config", "FP16", "get_bfloat16_config",
           "get_float16_config"]


def get_bfloat16_config(param_dict: dict[str, Any]) -> BF16Config:
    """The ``bf16`` section (or its old spelling ``bfloat16``) of a config dict, validated."""
    section = param_dict.get(BFLOAT16)
    if section is None:
        section = param_dict.get(BFLOAT16_OLD, {})
    return BF16Config(**section)


def get_float16_config(param_dict: dict[str, Any]) -> FP16Config:
    """The ``fp16`` section of a config dict, validated."""
    return FP16Config(**param_dict.get(FP16, {}))
