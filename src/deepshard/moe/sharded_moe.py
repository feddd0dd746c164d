"""``deepspeed.moe.sharded_moe``: the gate and layer classes under DeepSpeed's module path (``TopKGate``,
``MOELayer``), and DeepSpeed's gating functions ``top1gating`` / ``top2gating`` / ``topkgating``.

The gating functions are deepshard's own routing (:mod:`deepshard.moe.gate`, the same arithmetic and random
draws as DeepSpeed 0.19.8) returned in DeepSpeed's shapes, for code that routes tokens itself:

* dense (the default): ``(l_aux, combine_weights [S, E, C], dispatch_mask [S, E, C], exp_counts)``;
* ``sparse_routes=True``: ``(l_aux, capacity, num_experts, indices [k, S], locations [k, S], gates [k, S],
  exp_counts)``, indices and locations int32, a dropped route's index -1 (what deepshard's layer
  dispatches with: :func:`_route_slots`, :func:`_sparse_encode`, :func:`_sparse_decode` are its
  :func:`~deepshard.moe.dispatch.flat_slots`, :func:`~deepshard.moe.dispatch.dispatch` and
  :func:`~deepshard.moe.dispatch.combine`).

Without token dropping the capacity is the largest expert count over ``ep_group`` (a torch process group):
one ``all_reduce`` (max) through this module's ``dist`` (``deepspeed.comm``) where the group has more than
one rank; ``ep_group=None`` means no expert parallelism and touches no process group. deepshard's layer
exchanges tokens through :class:`_AllToAll` (``deepshard.moe.dispatch``). Tutel is never used here
(``TUTEL_INSTALLED`` is False).
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import Tensor

from deepshard import comm as dist
# _AllToAll: DeepSpeed's name of the layers' exchange (patching its apply reaches every layer)
from deepshard.moe.dispatch import _AllToAll, combine, dispatch, flat_slots  # noqa: F401
from deepshard.moe.gate import MaxOverGroup, Routing, TopKGate, top1_routing, top2_routing, topk_routing
from deepshard.moe.layer import MOELayer

__all__ = ["MOELayer", "TUTEL_INSTALLED", "TopKGate", "top1gating", "top2gating", "topkgating"]

TUTEL_INSTALLED = False
"""deepshard's layers dispatch with their own gather; Tutel's kernels are never imported."""

_route_slots = flat_slots
_sparse_encode = dispatch
_sparse_decode = combine

GatingResult = Union[tuple[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor, int, Tensor, Tensor, Tensor, Tensor]]


def _max_over(ep_group: Any) -> Optional[MaxOverGroup]:
    """The maximum over ``ep_group`` through ``dist.all_reduce`` (None for no group or a group of one rank,
    decided without a collective)."""
    if ep_group is None or dist.get_world_size(group=ep_group) <= 1:
        return None

    def largest(value: Tensor) -> Tensor:
        out = value.detach().reshape(1).clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=ep_group)
        return out.reshape(())
    return largest


def _result(routing: Routing, sparse_routes: bool) -> GatingResult:
    """``routing`` in DeepSpeed's return shapes (see the module docstring)."""
    capacity = torch.tensor(routing.capacity, dtype=torch.int64, device=routing.weights.device)
    if sparse_routes:
        return (routing.l_aux, capacity, routing.num_experts, routing.experts.to(torch.int32),
                routing.slots.to(torch.int32), routing.weights, routing.exp_counts)
    routes, num_tokens = routing.experts.shape
    token = torch.arange(num_tokens, device=routing.experts.device).expand(routes, num_tokens)
    kept = routing.experts >= 0
    combine_weights = routing.weights.new_zeros(num_tokens, routing.num_experts, routing.capacity).index_put(
        (token[kept], routing.experts[kept], routing.slots[kept]), routing.weights[kept], accumulate=True)
    return routing.l_aux, combine_weights, combine_weights.bool(), routing.exp_counts


def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Optional[Tensor] = None,
               noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: Any = None, sparse_routes: bool = False, use_tutel: bool = False) -> GatingResult:
    """Top-1 routing of ``logits`` ``[S, E]``: Gumbel noise when ``noisy_gate_policy`` is 'RSample', Random
    Token Selection of an over-full expert's tokens with ``use_rts``, ``used_token`` ``[S]`` masks tokens
    out. ``use_tutel`` changes nothing (the locations are the same cumulative sums)."""
    routing = top1_routing(logits, capacity_factor, min_capacity, used_token, noisy_gate_policy == "RSample",
                           drop_tokens, use_rts, _max_over(ep_group))
    return _result(routing, sparse_routes)


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, top2_2nd_expert_sampling: bool = True,
               sparse_routes: bool = False) -> GatingResult:
    """Top-2 routing of ``logits`` ``[S, E]`` (the second expert chosen with Gumbel noise unless
    ``top2_2nd_expert_sampling`` is False; capacity ``2 * capacity_factor`` slots per token share).
    Unlike DeepSpeed's, ``logits`` is left unchanged (DeepSpeed adds the noise to it in place)."""
    routing = top2_routing(logits, capacity_factor, min_capacity, drop_tokens, top2_2nd_expert_sampling,
                           _max_over(ep_group))
    return _result(routing, sparse_routes)


def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, drop_policy: str = "probs", sparse_routes: bool = False) -> GatingResult:
    """Top-k routing of ``logits`` ``[S, E]``: an over-full expert keeps the routes with the largest gate
    values (``drop_policy='probs'``) or its first tokens (``'position'``)."""
    routing = topk_routing(logits, k, capacity_factor, min_capacity, drop_tokens, _max_over(ep_group), drop_policy)
    return _result(routing, sparse_routes)
