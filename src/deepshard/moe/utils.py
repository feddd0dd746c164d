"""``deepspeed.moe.utils``: telling expert parameters from shared ones, and the optimizer groups they need.

An expert parameter is one marked as DeepSpeed marks them (``param.allreduce is False``; its
``param.group_name`` names its expert-parallel group, ``ep_size_<P>``). Its gradient is reduced over the
expert-data-parallel group instead of the whole data-parallel group, and ZeRO shards its optimizer state
there, so it must sit in an optimizer group of its own, marked ``'moe': True`` and named after the
expert-parallel group: :func:`split_params_into_different_moe_groups_for_optimizer` makes those groups
(DeepSpeed's engine does it itself for the optimizer it builds from the config:
:func:`configure_moe_param_groups`).
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn

from deepshard.moe.layer import MoE

__all__ = ["configure_moe_param_groups", "has_moe_layers", "is_moe_param", "is_moe_param_group",
           "split_params_grads_into_shared_and_expert_params", "split_params_into_different_moe_groups_for_optimizer",
           "split_params_into_shared_and_expert_params"]

ParamGroups = Union[dict[str, Any], tuple[dict[str, Any], ...], list[dict[str, Any]]]


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """(whether ``m`` holds a MoE layer, the expert count of the first one)."""
    for module in m.modules():
        if isinstance(module, MoE):
            return True, int(module.num_experts)
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is marked as an expert's (``param.allreduce is False``, DeepSpeed's marker)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(params: list[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(shared, expert) parameters of ``params``, each in the given order."""
    shared: list[nn.Parameter] = []
    expert: list[nn.Parameter] = []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(group: list[nn.Parameter]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(shared gradients, expert gradients) of the parameters that have a gradient, each in its
    parameter's dtype (what a norm over either kind is taken of)."""
    shared: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def _as_list(param_groups: ParamGroups) -> list[dict[str, Any]]:
    if isinstance(param_groups, tuple):
        return list(param_groups)
    if isinstance(param_groups, dict):
        return [param_groups]
    if isinstance(param_groups, list):
        return param_groups
    raise ValueError(f"Unknown param group type of {type(param_groups)}: pass a dict, or a list or tuple of "
                     "dicts, each with a 'params' list and a 'name'")


def _chunks(params: list[nn.Parameter], max_group_size: Optional[Union[int, float]]) -> list[list[nn.Parameter]]:
    """``params`` cut, in order, into runs of at most ``max_group_size`` elements (a larger parameter gets a
    run of its own); one run when there is no limit."""
    if max_group_size is None:
        return [params]
    runs: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        numel = int(getattr(p, "ds_numel", p.numel()))
        if current and size + numel > max_group_size:
            runs.append(current)
            current, size = [], 0
        current.append(p)
        size += numel
    if current:
        runs.append(current)
    return runs


def split_params_into_different_moe_groups_for_optimizer(param_groups: ParamGroups,
                                                         max_group_size: Union[int, float, None] = 178956971
                                                         ) -> list[dict[str, Any]]:
    """The optimizer's parameter groups with expert parameters moved into groups of their own.

    For each input group and each expert-parallel group name found among its expert parameters, a new group
    with the input group's options, ``'name': 'ep_size_<P>'`` and ``'moe': True`` holds those expert
    parameters (cut into groups of at most ``max_group_size`` elements); the new groups come after the
    originals, which keep only their shared parameters. A dict or tuple input becomes a list; the input
    groups are changed in place. Once the model has expert parameters every input group needs a ``'name'``
    (DeepSpeed's rule)."""
    groups = _as_list(param_groups)
    expert_names: list[str] = []  # in order of first appearance (DeepSpeed iterates a set)
    for group in groups:
        group["params"] = list(group["params"])
        for p in group["params"]:
            if is_moe_param(p) and p.group_name not in expert_names:  # type: ignore[attr-defined]
                expert_names.append(p.group_name)  # type: ignore[attr-defined]
    if not expert_names:
        return groups
    for group in groups:
        if "name" not in group:
            raise KeyError(f"'name': a parameter group of a model with expert parameters has no 'name' (its keys: "
                           f"{sorted(group)}); give every group a name, e.g. {{'params': ..., 'name': 'parameters'}}")
    split: list[dict[str, Any]] = []
    by_name: dict[tuple[str, str], list[nn.Parameter]] = {}
    for group in groups:
        shared, experts = split_params_into_shared_and_expert_params(group["params"])
        for p in experts:
            by_name.setdefault((group["name"], p.group_name), []).append(p)  # type: ignore[attr-defined]
        group["params"] = shared
    for group in groups:
        for expert_name in expert_names:
            params = by_name.pop((group["name"], expert_name), [])
            for run in _chunks(params, max_group_size) if params else []:
                split.append({**group, "name": expert_name, "moe": True, "params": run})
    return groups + split


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    """Whether the group was made for expert parameters (its ``moe`` flag)."""
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list[Any]) -> list[Any]:
    """Parameter groups ready for an optimizer of a model with experts (what DeepSpeed's engine does to the
    parameters of the optimizer it builds): a list of parameters becomes one group named ``dense-params``
    and is split; a list of groups is split unless one already has a ``moe`` key."""
    if not isinstance(model_parameters, list):
        raise TypeError(f"model_parameters must be a list, got {type(model_parameters).__name__}")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError("param argument that would be given to the optimizer should be an iterable of "
                            f"Tensors or dicts, but got {type(p)}")
    if not model_parameters:
        return model_parameters
    first = model_parameters[0]
    if isinstance(first, torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters, "name": "dense-params"})
    if not any("moe" in g for g in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters
