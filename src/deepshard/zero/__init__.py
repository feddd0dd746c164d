"""ZeRO strategies, one per stage, behind one interface (``deepshard.zero.strategy.ZeroStrategy``), and the
stage-3 user API with DeepSpeed's names: ``Init``, ``GatheredParameters``, ``register_external_parameter``.
"""
from __future__ import annotations

from typing import Any

import torch

from deepshard.zero.stage3.gather import GatheredParameters
from deepshard.zero.stage3.init import Init
from deepshard.zero.strategy import StrategyContext, ZeroStrategy

__all__ = ["GatheredParameters", "Init", "StrategyContext", "ZeroStrategy", "register_external_parameter"]


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter`` although another module owns it, so ZeRO-3
    gathers it around ``module``'s forward and backward too. Call it before ``deepshard.initialize``."""
    external: Any = module.__dict__.setdefault("_deepshard_external_params", [])
    if all(p is not parameter for p in external):
        external.append(parameter)
