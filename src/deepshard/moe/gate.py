"""The router of a mixture-of-experts layer: DeepSpeed's ``TopKGate`` (GShard top-1 / top-2, and top-k).

A gate turns ``S`` tokens into *routes*: for each of ``k`` choices per token, the expert it goes to (or -1
when the expert's capacity is full), its slot in that expert's buffer and its combine weight. It also
returns the load-balancing loss ``l_aux`` and the routing counts before any token is dropped.

The arithmetic follows DeepSpeed 0.19.8's gating functions, with the same random numbers drawn in the same
order from torch's global generator (through ``torch.distributions``, as DeepSpeed draws them), so a run
seeded as a DeepSpeed run routes every token as DeepSpeed does:

* top-1 (Lepikhin et al. 2020, "GShard"; Fedus et al. 2021, "Switch Transformers"): in training with the
  RSample policy, Gumbel noise ``[S, E]`` is added to the logits to choose; then, when Random Token
  Selection is on (every top-1 forward, eval included), one uniform draw ``[S, E]`` ranks the tokens of an
  over-full expert. The combine weight is the chosen expert's softmax probability (not renormalised).
* top-2: Gumbel noise ``[S, E]`` (train and eval, unless ``top2_2nd_expert_sampling`` is off) picks the
  second expert; second choices queue behind every first choice of the same expert; both weights are
  renormalised over the kept routes.
* top-k (k > 2): no random draws; an over-full expert keeps the tokens with the largest gate values (or,
  with ``drop_policy='position'``, its first tokens).
* Jitter (training only) multiplies the gate's fp32 input by a uniform ``[S, d]`` draw in [0.99, 1.01].

Capacity is per rank: ``max(ceil(S / E * capacity_factor * k'), min_capacity)`` with ``k' = 1, 2, k``.
Without token dropping it is the largest expert count, the maximum over the expert-parallel group.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["DROP_POLICIES", "NOISY_GATE_POLICIES", "Routing", "TopKGate", "capacity_for", "top1_routing",
           "top2_routing", "topk_routing"]

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
"""The values ``noisy_gate_policy`` accepts (DeepSpeed's)."""

MaxOverGroup = Callable[[Tensor], Tensor]
"""Reduces a 0-d integer tensor to its maximum over the expert-parallel group (identity on one rank)."""


@dataclass
class Routing:
    """Where each of a rank's ``S`` tokens goes, ``k`` routes per token (row ``r`` = the r-th choice)."""

    l_aux: Tensor
    """The load-balancing loss (0-d fp32, differentiable through the gate's logits)."""
    capacity: int
    """Slots per expert in the dispatch buffer ``[E, capacity, d]``."""
    num_experts: int
    experts: Tensor
    """``[k, S]`` int64: the expert of each route, -1 where the route was dropped (or masked out)."""
    slots: Tensor
    """``[k, S]`` int64: each route's position in its expert's buffer (0 for a dropped route)."""
    weights: Tensor
    """``[k, S]`` fp32: each route's combine weight (0 for a dropped route)."""
    exp_counts: Tensor
    """``[E]`` int64, detached: how many routes chose each expert before capacity dropped any."""


def capacity_for(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """``max(ceil(S / E * capacity_factor), min_capacity)``, the product rounded through fp32 as
    DeepSpeed's gate computes it (its capacity factor is a float32 tensor), so the capacity agrees with
    DeepSpeed's to the slot even where S/E * factor lands just above an integer."""
    product = _fp32(_fp32(num_tokens / num_experts) * _fp32(capacity_factor))  # exact in double, then rounded
    return max(int(math.ceil(product)), int(min_capacity))


def _fp32(value: float) -> float:
    """``value`` rounded to the nearest float32 (no tensor: this runs in every forward)."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def _uniform(shape: torch.Size, low: float, high: float, device: torch.device) -> Tensor:
    """``Uniform(low, high).rsample(shape)`` from torch's global generator (DeepSpeed's draw)."""
    dist = torch.distributions.uniform.Uniform(torch.tensor(low, device=device), torch.tensor(high, device=device))
    return dist.rsample(shape)


def _gumbel(shape: torch.Size, device: torch.device) -> Tensor:
    """``Gumbel(0, 1).rsample(shape)`` from torch's global generator (DeepSpeed's draw)."""
    dist = torch.distributions.gumbel.Gumbel(torch.tensor(0.0, device=device), torch.tensor(1.0, device=device))
    return dist.rsample(shape)


def _no_drop_capacity(exp_counts: Tensor, max_over_group: Optional[MaxOverGroup]) -> int:
    """Capacity without dropping: the largest expert count on any rank of the expert-parallel group."""
    largest = exp_counts.max()
    if max_over_group is not None:
        largest = max_over_group(largest)
    return int(largest.item())


def _balance_loss(gates: Tensor, first_choice: Tensor) -> Tensor:
    """``me * ce`` per expert: the mean gate probability times the share of first choices."""
    return gates.mean(dim=0) * first_choice.float().mean(dim=0)


def top1_routing(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Optional[Tensor] = None,
                 rsample: bool = False, drop_tokens: bool = True, use_rts: bool = True,
                 max_over_group: Optional[MaxOverGroup] = None) -> Routing:
    """Top-1 routing of ``logits`` ``[S, E]`` (fp32). ``rsample``: choose with Gumbel noise (training with
    the RSample policy); ``used_token``: a ``[S]`` 0/1 mask of the tokens that route at all."""
    noisy = logits + _gumbel(logits.shape, logits.device) if rsample else None
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    capacity = capacity_for(num_tokens, num_experts, capacity_factor, min_capacity)
    chosen = torch.argmax(noisy if noisy is not None else gates, dim=1)
    mask = F.one_hot(chosen, num_classes=num_experts)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach().to(torch.int64)
    if not drop_tokens:
        capacity = min(_no_drop_capacity(exp_counts, max_over_group), num_tokens)
    l_aux = _balance_loss(gates, mask).sum() * num_experts
    ranking = mask * _uniform(mask.shape, 0.0, 1.0, logits.device) if use_rts else mask
    if num_tokens < min_capacity:
        raise ValueError(f"a top-1 MoE gate got {num_tokens} tokens, fewer than min_capacity={min_capacity}: "
                         "set min_capacity to at most the tokens per rank (0 turns the floor off), or feed a "
                         "larger batch")
    # an over-full expert keeps the `capacity` tokens ranked highest (random with RTS, else by position)
    kept = torch.topk(ranking, k=min(capacity, num_tokens), dim=0)[1]
    mask = mask * torch.zeros_like(mask).scatter_(0, kept, 1)
    routed = mask.sum(dim=1) > 0
    slots = ((torch.cumsum(mask, dim=0) - 1) * mask).sum(dim=1)
    weights = (gates * mask.float()).sum(dim=1)
    experts = torch.where(routed, chosen, torch.full_like(chosen, -1))
    return Routing(l_aux, capacity, num_experts, experts.unsqueeze(0), slots.unsqueeze(0), weights.unsqueeze(0),
                   exp_counts)


def top2_routing(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
                 sample_second: bool = True, max_over_group: Optional[MaxOverGroup] = None) -> Routing:
    """Top-2 routing of ``logits`` ``[S, E]`` (fp32); ``sample_second``: the second expert is chosen
    with Gumbel noise (DeepSpeed's ``top2_2nd_expert_sampling``, drawn in eval too)."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=num_experts)
    if sample_second:
        logits = logits + _gumbel(logits.shape, logits.device)
    second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)
    slots1 = torch.cumsum(mask1, dim=0) - 1
    slots2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)  # behind every first choice
    l_aux = _balance_loss(gates, mask1).mean() * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach().to(torch.int64)
    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(slots1, capacity)
        mask2 = mask2 * torch.lt(slots2, capacity)
    else:
        capacity = _no_drop_capacity(exp_counts, max_over_group)
    weight1 = (gates * mask1.float()).sum(dim=1)
    weight2 = (gates * mask2.float()).sum(dim=1)
    denom = torch.clamp(weight1 + weight2, min=torch.finfo(torch.float32).eps)
    experts = torch.stack([torch.where(mask1.any(dim=1), first, torch.full_like(first, -1)),
                           torch.where(mask2.any(dim=1), second, torch.full_like(second, -1))])
    slots = torch.stack([(slots1 * mask1).sum(dim=1), (slots2 * mask2).sum(dim=1)])
    return Routing(l_aux, capacity, num_experts, experts, slots, torch.stack([weight1 / denom, weight2 / denom]),
                   exp_counts)


DROP_POLICIES = ("probs", "position")
"""How top-k routing chooses an over-full expert's tokens (DeepSpeed's ``drop_policy``): the largest gate
values, or the first tokens in order."""


def topk_routing(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
                 max_over_group: Optional[MaxOverGroup] = None, drop_policy: str = "probs") -> Routing:
    """Top-k routing (k > 2) of ``logits`` ``[S, E]`` (fp32): an over-full expert keeps the tokens with the
    largest gate values (``drop_policy='probs'``, the default) or its first tokens in token order
    (``'position'``); weights renormalised over kept routes."""
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"Invalid drop_policy: {drop_policy!r}; use one of {DROP_POLICIES} ('probs' keeps an "
                         "over-full expert's tokens with the largest gate values, 'position' its first tokens)")
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    if k > num_experts:
        raise ValueError(f"top-k gating with k={k} needs at least k experts, got num_experts={num_experts}")
    top_gates, top_experts = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_experts, True)
    exp_counts = mask.sum(dim=0).detach().to(torch.int64)
    l_aux = _balance_loss(gates, mask).mean() * num_experts * num_experts / k
    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "position":
            mask = mask & torch.lt(torch.cumsum(mask, dim=0) - 1, capacity)
        else:
            chosen_gates = torch.zeros_like(gates).scatter(1, top_experts, top_gates)
            kept = torch.topk(chosen_gates, k=min(capacity, num_tokens), dim=0, sorted=False)[1]
            mask = mask & torch.zeros_like(gates, dtype=torch.bool).scatter_(0, kept, True)
    else:
        capacity = _no_drop_capacity(exp_counts, max_over_group)
    positions = torch.cumsum(mask, dim=0) - 1
    masked = gates * mask
    masked = masked / torch.clamp(masked.sum(dim=-1, keepdim=True), min=torch.finfo(masked.dtype).eps)
    route_kept = mask.gather(1, top_experts)
    experts = torch.where(route_kept, top_experts, torch.full_like(top_experts, -1))
    slots = positions.gather(1, top_experts) * route_kept
    weights = masked.gather(1, top_experts)
    return Routing(l_aux, capacity, num_experts, experts.t().contiguous(), slots.t().contiguous(),
                   weights.t().contiguous(), exp_counts)


class TopKGate(nn.Module):
    """DeepSpeed's gate: a bias-free ``Linear(model_dim, num_experts)`` named ``wg`` whose fp32 logits are
    routed top-1, top-2 or top-k (see the module docstring). ``forward`` returns a :class:`Routing`
    (DeepSpeed's own returns dense combine/dispatch tensors; deepshard's layer dispatches sparsely)."""

    wg: nn.Linear

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group: Any = None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"Unsupported noisy_gate_policy: {noisy_gate_policy!r}; use one of "
                             f"{NOISY_GATE_POLICIES}")
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k (experts per token) must be a positive integer, got {k!r}")
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown = False
        self.gate_time = 0.0

    def _set_ep_group(self, ep_group: Any) -> None:
        """The expert-parallel group (a ``CommGroup``) for the no-drop capacity's maximum."""
        self.ep_group = ep_group

    def _max_over_group(self) -> Optional[MaxOverGroup]:
        group = self.ep_group
        if group is None or group.size <= 1:
            return None

        def largest(value: Tensor) -> Tensor:
            out = value.detach().reshape(1).clone()
            group.all_reduce_control(out, "all_reduce (max) of the MoE capacity", op="max",
                                     label="all_reduce(capacity)")
            return out.reshape(())
        return largest

    def forward(self, input: Tensor, used_token: Optional[Tensor] = None) -> Routing:  # noqa: A002 (DeepSpeed's name)
        """Route ``input`` ``[S, model_dim]``."""
        inputs = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            inputs = inputs * _uniform(inputs.shape, 1.0 - 1e-2, 1.0 + 1e-2, inputs.device)
        logits = F.linear(inputs, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            rsample = self.training and self.noisy_gate_policy == "RSample"
            return top1_routing(logits, factor, self.min_capacity, used_token, rsample, self.drop_tokens,
                                self.use_rts, self._max_over_group())
        if self.k == 2:
            return top2_routing(logits, factor, self.min_capacity, self.drop_tokens, self.top2_2nd_expert_sampling,
                                self._max_over_group())
        return topk_routing(logits, self.k, factor, self.min_capacity, self.drop_tokens, self._max_over_group())
