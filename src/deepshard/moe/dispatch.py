"""Moving tokens to their experts and back: the dispatch buffer, the expert-parallel all-to-all, the
weighted combine.

A rank's routes (``gate.Routing``) name, for every token and choice, an expert and a slot. Dispatch
gathers the tokens into a buffer ``[E, capacity, d]`` (one gather: each slot reads the token routed to it,
or a zero row). With expert parallelism over ``P`` ranks the buffer's first dimension is cut into ``P``
blocks of ``E / P`` experts and exchanged by one all-to-all (Lepikhin et al. 2020, "GShard", algorithm 2):
rank ``p`` receives, from every rank of its group, the slots of the experts it holds. The experts' outputs
go back by a second all-to-all, and each token's output is the sum of its routes' outputs times their
combine weights (accumulated in fp32, as DeepSpeed does, then cast to the experts' dtype). Both
all-to-alls are autograd functions whose backward is again an all-to-all.

The all-to-all runs through the group's ``CommGroup.all_to_all_single``: pairwise send/receive exchanges
on gloo (which has no native all-to-all), the backend's own collective on NCCL; bytes are counted as
``<group>:all_to_all``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from deepshard.moe.gate import Routing

__all__ = ["all_to_all", "combine", "dispatch", "flat_slots", "route_slots"]


class _AllToAll(torch.autograd.Function):
    """Row block ``k`` of the input goes to rank ``k`` of ``group``; the backward sends gradients back the
    same way (an all-to-all is its own transpose)."""

    @staticmethod
    def forward(ctx: Any, group: Any, data: Tensor) -> Tensor:  # type: ignore[override]
        ctx.group = group
        data = data.contiguous()
        out = torch.empty_like(data)
        group.all_to_all_single(out, data)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:  # type: ignore[override]
        return None, _AllToAll.apply(ctx.group, grad)


def all_to_all(group: Any, data: Tensor) -> Tensor:
    """The autograd all-to-all of ``data`` (first dimension divisible by the group size) over ``group``
    (a ``CommGroup``); a group of one rank returns ``data`` unchanged."""
    if group is None or group.size == 1:
        return data.contiguous()
    if data.shape[0] % group.size != 0:
        raise ValueError(f"all_to_all over {group.size} ranks needs a first dimension divisible by {group.size}, "
                         f"got shape {tuple(data.shape)}")
    return _AllToAll.apply(group, data)


def route_slots(routing: Routing) -> Tensor:
    """``[k, S]`` flat slot index ``expert * capacity + slot`` of every route; a dropped route points at
    the spare slot ``E * capacity`` that dispatch leaves empty and combine reads as zero."""
    return flat_slots(routing.experts, routing.slots, routing.num_experts, routing.capacity)


def flat_slots(experts: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """:func:`route_slots` from the routes' tensors: ``experts`` ``[k, S]`` (-1 for a dropped route) and
    ``slots`` ``[k, S]``, of any integer dtype; int64 flat indices into ``[E * capacity + 1]``."""
    flat = experts.long() * capacity + slots.long()
    return torch.where(experts >= 0, flat, torch.full_like(flat, num_experts * capacity))


def dispatch(tokens: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """The buffer ``[E, capacity, d]`` holding, at each routed slot, its token (zeros elsewhere):
    ``tokens`` ``[S, d]``, ``slots`` from :func:`route_slots`."""
    num_tokens, width = tokens.shape
    spare = num_experts * capacity
    # which token each slot reads; unrouted slots read the zero row appended at index S
    source = torch.full((spare + 1,), num_tokens, dtype=torch.long, device=tokens.device)
    token_ids = torch.arange(num_tokens, device=tokens.device).expand_as(slots)
    source.scatter_(0, slots.reshape(-1), token_ids.reshape(-1))
    padded = torch.cat([tokens, tokens.new_zeros(1, width)])
    return padded.index_select(0, source[:spare]).view(num_experts, capacity, width)


def combine(expert_out: Tensor, slots: Tensor, weights: Tensor, num_tokens: int) -> Tensor:
    """Each token's output ``[S, d]``: the sum over its routes of the slot's expert output times the
    route's fp32 weight, summed in fp32 and cast to ``expert_out``'s dtype. ``expert_out`` is
    ``[E * capacity, d]``."""
    width = expert_out.shape[-1]
    padded = torch.cat([expert_out, expert_out.new_zeros(1, width)])
    routed = padded.index_select(0, slots.reshape(-1)).view(slots.shape[0], num_tokens, width)
    return (routed * weights.unsqueeze(-1)).sum(dim=0).to(expert_out.dtype)
