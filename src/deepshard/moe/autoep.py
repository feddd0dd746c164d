"""AutoEP: the experts of Hugging Face MoE blocks split over expert-parallel ranks, the model's code unchanged
(DeepSpeed's ``expert_parallel`` config section).

transformers 5 keeps a MoE block's experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...) in one module with two
fused 3-D parameters, ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, called as
``experts(hidden_states [S, H], top_k_index [S, k], top_k_weights [S, k])`` after the block's router chose the
experts. AutoEP keeps the router (a dense, replicated parameter) and replaces, on each such module, the two
parameters by this rank's slice of ``E / P`` experts and the forward by an exchange:

1. every route (token, choice) goes to the rank holding its expert: the routes are sorted by destination and
   sent with one all-to-all over the expert-parallel group, padded to the largest count any rank sends any
   rank (token counts differ per rank and step: nothing is dropped, unlike DeepSpeed's capacity);
2. each rank runs its experts on the tokens it received (the model's own activation, ``_apply_gate`` where
   the class has one);
3. the outputs come back by a second all-to-all and are added into each token's output times its route's
   weight, as the model's own forward adds them.

So the block computes what it computes on one process, every token reaching its experts; the losses equal
the dense run's (to round-off). The sliced parameters are recorded as expert shards
(``placement.ExpertShard`` with the slice's offset in the whole ``[E, ...]`` tensor): ZeRO reduces and shards
them over the expert-data-parallel group, checkpoints store the whole tensors under the model's own names.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from deepshard.moe.autoep_config import AutoEPConfig
from deepshard.moe.autoep_layer import BlockRouting, adopt_block, block_routing
from deepshard.moe.dispatch import all_to_all
from deepshard.placement import mark_expert
from deepshard.topology import Topology

__all__ = ["AutoEPConfig", "apply_autoep", "expert_modules"]

FUSED = ("gate_up_proj", "down_proj")
UNSUPPORTED_LAYOUTS = ("has_bias", "is_transposed", "has_post_expert_norm")


def fused_weight(module: nn.Module, name: str) -> Tensor:
    """The fused experts' 3-D weight ``name`` (``gate_up_proj`` or ``down_proj``) of ``module``."""
    weight = getattr(module, name)
    if not isinstance(weight, Tensor):
        raise TypeError(f"AutoEP: {type(module).__name__}.{name} is {type(weight).__name__}, not the fused experts' "
                        "3-D weight; AutoEP splits modules holding gate_up_proj and down_proj as parameters")
    return weight


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every fused-experts module of ``model`` (both 3-D parameters, one slice per
    expert along dimension 0), in module order."""
    found = []
    for name, module in model.named_modules():
        params = [p for p in (getattr(module, f, None) for f in FUSED) if isinstance(p, nn.Parameter) and p.dim() == 3]
        if len(params) == len(FUSED) and params[0].shape[0] == params[1].shape[0]:
            found.append((name, module))
    return found


def _check_layout(name: str, module: nn.Module, size: int) -> int:
    experts = int(fused_weight(module, "gate_up_proj").shape[0])
    bad = [flag for flag in UNSUPPORTED_LAYOUTS if getattr(module, flag, False)]
    if bad or getattr(module, "is_concatenated", True) is False:
        raise NotImplementedError(f"AutoEP: experts module {name} ({type(module).__name__}) has {bad or 'interleaved'} "
                                  "weights; deepshard splits the concatenated [E, 2I, H] / [E, H, I] layout "
                                  "(Mixtral, Qwen2/3-MoE, OLMoE); turn expert_parallel off for this model")
    if experts % size != 0:
        raise ValueError(f"AutoEP: {name} has {experts} experts, which expert_parallel.autoep_size={size} does not "
                         f"divide; use an autoep_size that divides {experts}")
    return experts


@torch.no_grad()
def _keep_slice(module: nn.Module, prefix: str, group: str, ep_rank: int, size: int) -> None:
    """Replace the fused parameters by this rank's experts, recorded as expert shards."""
    for field in FUSED:
        whole = getattr(module, field)
        local = whole.shape[0] // size
        part = nn.Parameter(whole[ep_rank * local:(ep_rank + 1) * local].detach().clone(),
                            requires_grad=whole.requires_grad)
        setattr(module, field, part)
        name = f"{prefix}.{field}" if prefix else field
        mark_expert(part, group, name, (name,), offset=ep_rank * part.numel(), global_shape=tuple(whole.shape))


def apply_autoep(model: nn.Module, topology: Topology, size: int, preset: Optional[str] = None) -> Topology:
    """Split every fused-experts module of ``model`` over ``size`` expert-parallel ranks (collective: every rank
    calls it) and make each block holding one an ``AutoEPMoELayer`` (:mod:`deepshard.moe.autoep_layer`);
    returns the topology with the ``ep_size_<size>`` groups. ``preset``: ``expert_parallel.preset_model``."""
    found = expert_modules(model)
    if not found:
        raise ValueError("expert_parallel is enabled but the model has no fused experts module (3-D gate_up_proj "
                         "and down_proj parameters, as transformers 5's Mixtral, Qwen2/3-MoE and OLMoE blocks hold "
                         "them); disable the section for this model")
    routings: dict[str, tuple[str, nn.Module, BlockRouting]] = {}
    for name, module in found:  # every module and block checked before anything changes
        _check_layout(name, module, size)
        parent = _parent(model, name)
        if parent is not None:  # a block it cannot route for raises here
            routings[name] = (*parent, block_routing(parent[1], name.rsplit(".", 1)[-1], module_path=parent[0],
                                                     ep_size=size, preset=preset))
    topology = topology.with_experts([size])
    groups = topology.experts[f"ep_size_{size}"]
    for layer_id, (name, module) in enumerate(found):
        if name in routings:
            path, block, routing = routings[name]
            adopt_block(block, routing, module_path=path, moe_layer_id=layer_id,
                        num_experts=int(fused_weight(module, "gate_up_proj").shape[0]), groups=groups)
        _keep_slice(module, name, groups.name, groups.ep_rank, size)
        module.forward = ExpertParallelForward(module, groups.ep, groups.ep_rank, size)  # type: ignore[method-assign]
    return topology


def _parent(model: nn.Module, name: str) -> Optional[tuple[str, nn.Module]]:
    """``(name, module)`` of the module holding the child ``name`` (None for the model itself)."""
    if "." not in name:
        return None if not name else ("", model)
    path = name.rsplit(".", 1)[0]
    return path, model.get_submodule(path)


class ExpertParallelForward:
    """The forward installed on a fused-experts module (see the module docstring)."""

    def __init__(self, module: nn.Module, group: Any, ep_rank: int, size: int) -> None:
        self.module, self.group, self.ep_rank, self.size = module, group, ep_rank, size

    def __call__(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        module = self.module
        local = int(fused_weight(module, "gate_up_proj").shape[0])
        total = local * self.size
        width = hidden_states.shape[-1]
        experts = top_k_index.reshape(-1)
        tokens = torch.arange(hidden_states.shape[0], device=hidden_states.device).repeat_interleave(top_k_index.shape[1])
        weights = top_k_weights.reshape(-1)
        keep = (experts >= 0) & (experts < total)  # an index of E marks "no expert" in some models
        experts, tokens, weights = experts[keep], tokens[keep], weights[keep]
        order = torch.argsort(experts, stable=True)  # by destination rank, then expert
        experts, tokens, weights = experts[order], tokens[order], weights[order]
        dest = torch.div(experts, local, rounding_mode="floor")
        counts = torch.bincount(dest, minlength=self.size)
        capacity = self._largest(counts)
        slot = torch.arange(experts.numel(), device=experts.device) - torch.cumsum(counts, 0).sub(counts)[dest]
        rows = dest * capacity + slot  # each route's row in the [P * capacity] send buffer
        send = hidden_states.new_zeros(self.size * capacity, width).index_copy(0, rows, hidden_states[tokens])
        ids = torch.full((self.size * capacity,), -1, dtype=torch.long, device=experts.device)
        ids[rows] = experts - dest * local  # the receiver's local expert id
        received = all_to_all(self.group, send.view(self.size, capacity, width)).reshape(-1, width)
        received_ids = self._exchange_ids(ids.view(self.size, capacity)).reshape(-1)
        out = self._run_experts(received, received_ids, local)
        back = all_to_all(self.group, out.view(self.size, capacity, width)).reshape(-1, width)
        routed = back.index_select(0, rows) * weights.unsqueeze(-1)  # in the weights' dtype, as the model does
        return torch.zeros_like(hidden_states).index_add(0, tokens, routed.to(hidden_states.dtype))

    def _largest(self, counts: Tensor) -> int:
        """The buffer's rows per destination: the most routes any rank sends any rank (at least 1)."""
        top = counts.max().reshape(1).clone()
        if self.group is not None and self.group.size > 1:
            self.group.all_reduce_control(top, "all_reduce (max) of the AutoEP routes", op="max",
                                          label="all_reduce(capacity)")
        return max(int(top.item()), 1)

    def _exchange_ids(self, ids: Tensor) -> Tensor:
        if self.group is None or self.group.size == 1:
            return ids
        out = torch.empty_like(ids)
        self.group.all_to_all_single(out, ids.contiguous())
        return out

    def _run_experts(self, tokens: Tensor, ids: Tensor, local: int) -> Tensor:
        """Each received token through its local expert; padding rows (id -1) stay zero."""
        module = self.module
        out = torch.zeros_like(tokens)
        gate: Callable[[Tensor], Tensor] = getattr(module, "_apply_gate", None) or self._gate_up
        gate_up_proj, down_proj = fused_weight(module, "gate_up_proj"), fused_weight(module, "down_proj")
        for e in range(local):
            rows = (ids == e).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            hidden = gate(nn.functional.linear(tokens.index_select(0, rows), gate_up_proj[e]))
            out = out.index_copy(0, rows, nn.functional.linear(hidden, down_proj[e]))
        return out

    def _gate_up(self, gate_up: Tensor) -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        # the experts' own activation; SiLU (SwiGLU experts) for experts modules without one (DeepSpeed's default)
        act_fn: Callable[[Tensor], Tensor] = getattr(self.module, "act_fn", None) or nn.functional.silu
        return act_fn(gate) * up
