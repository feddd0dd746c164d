"""ZeRO strategies, one per stage, behind one interface (``deepshard.zero.strategy.ZeroStrategy``), and the
stage-3 user API with DeepSpeed's names: ``Init``, ``GatheredParameters``, ``register_external_parameter``.
"""
from __future__ import annotations


import torch

from deepshard.zero.stage3.gather import GatheredParameters
from deepshard.zero.stage3.generation import unwrap_model_for_generation
from deepshard.zero.stage3.init import Init
from deepshard.zero.stage3.param_status import ZeroParamStatus
from deepshard.zero.stage3.surface import external_registry
from deepshard.zero.strategy import StrategyContext, ZeroStrategy
from deepshard.zero.tiling import TiledLinear, TiledLinearReturnBias

__all__ = ["GatheredParameters", "Init", "StrategyContext", "TiledLinear", "TiledLinearReturnBias",
           "ZeroParamStatus", "ZeroStrategy",
           "register_external_parameter", "unregister_external_parameter", "unwrap_model_for_generation"]


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter`` although another module owns it, so ZeRO-3
    gathers it around ``module``'s forward and backward too. Call it before ``deepshard.initialize``.
    Kept where DeepSpeed keeps it: ``module._external_params`` (``{id(param): param}``), listed by
    ``module.ds_external_parameters()``."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(f"register_external_parameter: expected a torch.nn.Parameter, got {type(parameter).__name__}; "
                        "register the module's parameter itself (e.g. other_module.weight)")
    external_registry(module)[id(parameter)] = parameter


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undo :func:`register_external_parameter` (before ``deepshard.initialize``, like registering)."""
    registry = external_registry(module)
    if id(parameter) not in registry:
        raise ValueError(f"unregister_external_parameter: the parameter (shape {tuple(parameter.shape)}) is not "
                         f"registered as external on this {type(module).__name__}")
    del registry[id(parameter)]
