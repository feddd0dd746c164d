"""``deepspeed.moe.utils`` under deepshard, for models without expert layers.

An expert parameter is one marked as DeepSpeed marks them (``param.allreduce is False``); deepshard never
creates one. With none present these functions do what DeepSpeed's do for a dense model: every parameter
is shared, and the optimizer groups come back as they were (a dict or tuple given as a list, each group
with its parameters). A parameter marked as an expert's is refused: deepshard cannot train experts.
"""
from __future__ import annotations

from typing import Any, Union

import torch
from torch import nn

from deepshard.moe.layer import MoE

__all__ = ["configure_moe_param_groups", "has_moe_layers", "is_moe_param", "is_moe_param_group",
           "split_params_grads_into_shared_and_expert_params", "split_params_into_different_moe_groups_for_optimizer",
           "split_params_into_shared_and_expert_params"]

ParamGroups = Union[dict[str, Any], tuple[dict[str, Any], ...], list[dict[str, Any]]]


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """(whether ``m`` holds a MoE layer, its expert count): (False, 0) for every model deepshard trains."""
    for module in m.modules():
        if isinstance(module, MoE):  # pragma: no cover - MoE cannot be built under deepshard
            return True, int(getattr(module, "num_experts", 0))
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is marked as an expert's (``param.allreduce is False``, DeepSpeed's marker)."""
    return hasattr(param, "allreduce") and not param.allreduce


def _refuse_experts(params: Any) -> None:
    for p in params:
        if is_moe_param(p):
            raise NotImplementedError(
                f"a parameter of shape {tuple(p.shape)} is marked as a mixture-of-experts parameter "
                "(allreduce=False): deepshard has no expert parallelism; train a dense model, or use the real "
                "DeepSpeed for MoE")


def split_params_into_shared_and_expert_params(params: list[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(shared, expert) parameters: all of ``params`` are shared (expert parameters are refused)."""
    params = list(params)
    _refuse_experts(params)
    return params, []


def split_params_grads_into_shared_and_expert_params(group: list[nn.Parameter]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(shared gradients, expert gradients) of the parameters that have a gradient, each in its
    parameter's dtype; there are no expert gradients (expert parameters are refused)."""
    params = list(group)
    _refuse_experts(params)
    return [p.grad.to(p.dtype) for p in params if p.grad is not None], []


def split_params_into_different_moe_groups_for_optimizer(param_groups: ParamGroups,
                                                         max_group_size: Union[int, float, None] = 178956971
                                                         ) -> list[dict[str, Any]]:
    """The optimizer's parameter groups with expert parameters split into groups of their own: for a
    model without experts, ``param_groups`` as a list (a dict becomes a one-group list, a tuple a list),
    each group unchanged. ``max_group_size`` only bounds expert groups, of which there are none."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}: pass a dict, or a list or "
                         "tuple of dicts, each with a 'params' list")
    for group in param_groups:
        group["params"] = list(group["params"])
        _refuse_experts(group["params"])
    return param_groups


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    """Whether the group was made for expert parameters (its ``moe`` flag)."""
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list[Any]) -> list[Any]:
    """Parameter groups ready for an optimizer: a list of parameters becomes one group named
    ``dense-params``; a list of groups comes back as groups (split as above unless a group already has
    a ``moe`` key)."""
    if not isinstance(model_parameters, list):
        raise TypeError(f"model_parameters must be a list, got {type(model_parameters).__name__}")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError("param argument that would be given to the optimizer should be an iterable of "
                            f"Tensors or dicts, but got {type(p)}")
    first = model_parameters[0]
    if isinstance(first, nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters, "name": "dense-params"})
    if isinstance(first, dict) and not any("moe" in g for g in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters
