"""The experts of one MoE layer on this rank: DeepSpeed's ``Experts`` (``deepspeed.moe.experts``).

The layer's ``expert`` module is deep-copied once per local expert into ``deepspeed_experts`` (so every
expert starts from the same weights, as in DeepSpeed), and each copy's parameters are marked as DeepSpeed
marks them: ``allreduce = False`` (not reduced over the whole data-parallel group) and ``group_name =
"ep_size_<P>"`` (the expert-parallel group that holds them). That marker is what
:func:`deepshard.moe.utils.is_moe_param`, the optimizer-group split and the engine key on.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

__all__ = ["Experts", "mark_expert_params"]


def mark_expert_params(module: nn.Module, group_name: Optional[str]) -> None:
    """Mark every parameter of ``module`` as an expert's (DeepSpeed's attributes)."""
    for param in module.parameters():
        param.allreduce = False  # type: ignore[attr-defined]
        param.group_name = group_name  # type: ignore[attr-defined]


class Experts(nn.Module):
    """``num_local_experts`` copies of ``expert``; ``forward`` gives copy ``i`` the ``i``-th slice of
    dimension 1 of its input ``[ep_size, num_local_experts, capacity, d]`` (tokens from every rank of the
    expert-parallel group) and concatenates the outputs along that dimension."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: Optional[str] = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for local in self.deepspeed_experts:
            mark_expert_params(local, expert_group_name)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)  # an expert returning (out, bias)
        return torch.cat(outputs, dim=1)
