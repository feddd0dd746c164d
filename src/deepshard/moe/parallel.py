"""The composer's expert-parallel step (``deepshard.parallelize``): what DeepSpeed's engine does for MoE
layers at ``initialize``, done once for the whole model before anything else is built.

1. Find the model's MoE layers (``deepshard.moe.layer.MoE``) and their expert-parallel sizes, in module
   order (the same on every rank).
2. Create each size's expert-parallel and expert-data-parallel groups (``Topology.with_experts``).
3. Give each layer its expert-parallel group (the all-to-all's and the no-drop capacity's group).
4. Record, on every expert parameter of a layer with ``ep_size`` > 1, its group and its name with the
   layer's global expert id (``placement.mark_expert``): the ZeRO strategies reduce and shard it over the
   expert-data-parallel group, checkpoints store it under that name.
5. Make the replicas of each expert equal: broadcast from the first rank of its expert-data-parallel
   group, within that group only (the dense parameters come from data-parallel rank 0 as before).

With ``ep_size`` 1 every rank holds every expert: its parameters are reduced, sharded and saved exactly as
dense ones (DeepSpeed's arithmetic gives the same numbers: the expert-data-parallel group is then the whole
data-parallel group).
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from deepshard.comm.scratch import release
from deepshard.moe.layer import MoE
from deepshard.placement import expert_of, mark_expert
from deepshard.topology import Topology

__all__ = ["attach_experts", "broadcast_experts", "expert_param_ids", "moe_layers", "saved_expert_name"]

_LOCAL = re.compile(r"(^|\.)deepspeed_experts\.(\d+)(\.|$)")


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """``(name, layer)`` of every MoE layer of ``model``, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def saved_expert_name(local_name: str, layer: MoE, ep_rank: int) -> str:
    """``local_name`` (a parameter name inside ``layer``'s local experts, ``...deepspeed_experts.<i>...``)
    with the global expert id ``ep_rank * num_local_experts + i`` (DeepSpeed's numbering)."""
    def to_global(match: "re.Match[str]") -> str:
        global_id = ep_rank * layer.num_local_experts + int(match.group(2))
        return f"{match.group(1)}deepspeed_experts.{global_id}{match.group(3)}"

    return _LOCAL.sub(to_global, local_name, count=1)


def _with_expert_id(name: str, expert: int) -> str:
    return _LOCAL.sub(lambda m: f"{m.group(1)}deepspeed_experts.{expert}{m.group(3)}", name, count=1)


def attach_experts(model: nn.Module, topology: Topology, data_before_expert: bool = False) -> Topology:
    """Steps 1-4 of the module docstring (collective: every rank calls it); returns the topology with the
    expert groups (``topology`` itself when the model has no MoE layer)."""
    layers = moe_layers(model)
    if not layers:
        return topology
    sizes: list[int] = []
    for _, layer in layers:
        if layer.ep_size not in sizes:
            sizes.append(layer.ep_size)
    topology = topology.with_experts(sizes, data_before_expert)
    for prefix, layer in layers:
        groups = topology.experts[layer.expert_group_name]
        layer.deepspeed_moe._set_ep_group(groups.ep)
        if layer.ep_size == 1:
            continue
        experts = layer.deepspeed_moe.experts
        for name, param in experts.named_parameters(prefix=f"{prefix}.deepspeed_moe.experts" if prefix
                                                     else "deepspeed_moe.experts"):
            every = tuple(_with_expert_id(name, g) for g in range(layer.num_experts))
            mark_expert(param, groups.name, saved_expert_name(name, layer, groups.ep_rank), every)
    return topology


def expert_param_ids(params: Iterable[torch.Tensor]) -> set[int]:
    """``id`` of each parameter of ``params`` recorded as an expert's (split over ep ranks)."""
    return {id(p) for p in params if expert_of(p) is not None}


@torch.no_grad()
def broadcast_experts(model: nn.Module, topology: Topology) -> None:
    """Step 5: each expert parameter from the first rank of its expert-data-parallel group (one flat
    broadcast per group and dtype)."""
    by_group: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
    for p in model.parameters():
        found = expert_of(p)
        if found is not None:
            by_group.setdefault((found.group, p.dtype), []).append(p)
    for (name, _), params in by_group.items():
        comm = topology.experts[name].edp
        if comm.size == 1:
            continue
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        comm.broadcast(flat, src=0)
        offset = 0
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        release(flat)  # now, not when gloo's worker thread drops the broadcast (comm/scratch.py)

