"""``deepspeed.moe.layer.MoE``: DeepSpeed's mixture-of-experts layer, with its constructor, defaults,
parameter names and return value, so a DeepSpeed model builds, loads DeepSpeed's state dicts and trains
unchanged (Lepikhin et al. 2020, "GShard"; Rajbhandari et al. 2022, "DeepSpeed-MoE").

Structure (the names appear in state dicts and checkpoints)::

    MoE
      deepspeed_moe          MOELayer
        gate                 TopKGate: wg, a bias-free Linear(hidden_size, num_experts)   (dense parameter)
        experts              Experts: deepspeed_experts.<i>, num_experts / ep_size copies (expert parameters)
      mlp, coefficient       with use_residual only: the dense branch and Linear(hidden_size, 2) (dense)

``forward(hidden_states, used_token=None)`` returns ``(output, l_aux, exp_counts)``; the caller adds
``l_aux`` to its loss as it likes (the engine never does). Process groups are not made here:
``deepshard.initialize`` gives each layer its expert-parallel group (``deepshard.moe.groups``), as
DeepSpeed's engine calls ``set_deepspeed_parallelism`` at initialize. A layer with ``ep_size`` 1 also runs
without any engine (plain PyTorch).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepshard.moe.dispatch import all_to_all, combine, dispatch, route_slots
from deepshard.moe.experts import Experts
from deepshard.moe.gate import NOISY_GATE_POLICIES, Routing, TopKGate
from deepshard.utils.logging import logger

__all__ = ["MOELayer", "MoE"]


class MOELayer(nn.Module):
    """Gate, dispatch, experts, combine (``deepspeed.moe.sharded_moe.MOELayer``). After each forward,
    ``l_aux`` and ``exp_counts`` hold the gate's load-balancing loss and routing counts."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int, num_local_experts: int,
                 use_tutel: bool = False) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group: Any = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.use_tutel = False  # deepshard dispatches with its own gather; Tutel's kernels are not used
        self.wall_clock_breakdown = False
        self.l_aux: Tensor = torch.zeros(())  # until the first forward
        self.exp_counts: Tensor = torch.zeros(gate.wg.out_features, dtype=torch.int64)

    def _set_ep_group(self, ep_group: Any) -> None:
        """This layer's expert-parallel group (a ``deepshard.comm.CommGroup`` of ``ep_size`` ranks)."""
        if ep_group is not None and ep_group.size != self.ep_size:
            raise ValueError(f"MoE layer with ep_size={self.ep_size} was given an expert-parallel group of "
                             f"{ep_group.size} ranks; the group must have ep_size ranks")
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def _exchange(self, data: Tensor) -> Tensor:
        if self.ep_size == 1:
            return data.contiguous()
        if self.ep_group is None:
            raise RuntimeError(f"this MoE layer has ep_size={self.ep_size} but no expert-parallel group: groups are "
                               "made by deepshard.initialize (deepspeed.initialize) for every MoE layer of the "
                               "model; build the engine first, or use ep_size=1 outside an engine")
        return all_to_all(self.ep_group, data)

    def _common_capacity(self, routing: Routing) -> Routing:
        """``routing`` with the buffer's capacity made the largest of the expert-parallel group's.

        A rank's capacity follows its own token count, and the all-to-all needs one buffer shape on every rank
        of the group: with uneven token counts per rank (DeepSpeed's ranks then exchange buffers of different
        sizes and fail or hang) each rank pads its buffer to the largest. Which tokens a rank keeps still
        follows its own capacity, so equal counts give DeepSpeed's routing unchanged."""
        if self.ep_size == 1 or self.ep_group is None:
            return routing
        largest = torch.tensor([routing.capacity], dtype=torch.float32, device=routing.exp_counts.device)
        self.ep_group.all_reduce_control(largest, "all_reduce (max) of the MoE buffer's capacity", op="max",
                                         label="all_reduce(capacity)")
        capacity = int(largest.item())
        return routing if capacity == routing.capacity else dataclasses.replace(routing, capacity=capacity)

    def forward(self, *inputs: Tensor, **kwargs: Any) -> Tensor:
        hidden = inputs[0]
        used_token = inputs[1] if len(inputs) > 1 else kwargs.get("used_token")
        width = hidden.shape[-1]
        tokens = hidden.reshape(-1, width)
        routing = self.gate(tokens, used_token)
        self.l_aux, self.exp_counts = routing.l_aux, routing.exp_counts
        routing = self._common_capacity(routing)
        experts, capacity = routing.num_experts, routing.capacity
        slots = route_slots(routing)
        buffer = self._exchange(dispatch(tokens, slots, experts, capacity))
        out = self.experts(buffer.reshape(self.ep_size, self.num_local_experts, -1, width))
        out = self._exchange(out.reshape(self.ep_size * self.num_local_experts, -1, width))
        return combine(out.reshape(experts * capacity, width), slots, routing.weights, tokens.shape[0]).reshape(hidden.shape)


class MoE(nn.Module):
    """DeepSpeed's MoE layer (see the module docstring). ``num_experts`` must be a multiple of ``ep_size``
    (each expert-parallel rank holds ``num_experts // ep_size`` of them); ``k`` experts per token (1, 2, or
    more); ``capacity_factor`` / ``eval_capacity_factor`` size each expert's buffer in training / eval,
    never below ``min_capacity``; ``drop_tokens=False`` sizes it for every token instead; ``use_rts``
    keeps a random choice of an over-full expert's tokens (top-1); ``noisy_gate_policy`` 'Jitter' or
    'RSample' adds noise to routing in training (top-1); ``use_residual`` also runs ``expert`` as a dense
    MLP mixed in by a learned coefficient (Residual MoE, Rajbhandari et al. 2022)."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        _check_arguments(num_experts, ep_size, noisy_gate_policy)
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        if use_tutel:
            logger.warning("MoE(use_tutel=True): deepshard does not use Tutel's kernels; the layer dispatches "
                           "with its own gather (same results)")
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)  # the mix of the MoE and dense outputs

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's engine calls this at initialize to make the layer's groups; deepshard's
        ``initialize`` gives the layer its group itself, so there is nothing to do once it has run."""
        if self.ep_size > 1 and self.deepspeed_moe.ep_group is None:
            raise RuntimeError("MoE.set_deepspeed_parallelism: deepshard makes the expert-parallel groups in "
                               "deepshard.initialize (deepspeed.initialize); pass the model containing this layer "
                               "to it instead of calling this method")

    def forward(self, hidden_states: Tensor, used_token: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
        """``(output, l_aux, exp_counts)`` for ``hidden_states`` ``[..., hidden_size]``; ``used_token``
        (``[tokens]`` 0/1, top-1 only) leaves masked tokens unrouted."""
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def _check_arguments(num_experts: int, ep_size: int, noisy_gate_policy: Optional[str]) -> None:
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"ep_size must be a positive integer, got {ep_size!r}")
    if not isinstance(num_experts, int) or num_experts < 1 or num_experts % ep_size != 0:
        raise ValueError(f"Number of experts ({num_experts}) should be divisible by expert parallel size "
                         f"({ep_size}): each of the {ep_size} expert-parallel ranks holds num_experts / ep_size "
                         "experts; choose num_experts as a multiple of ep_size")
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(f"Unsupported noisy_gate_policy: {noisy_gate_policy!r}; use one of {NOISY_GATE_POLICIES}")
