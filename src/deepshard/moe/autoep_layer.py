"""The MoE block after AutoEP: ``AutoEPMoELayer`` (``deepspeed.module_inject.auto_ep_layer.AutoEPMoELayer``).

DeepSpeed's AutoEP replaces each MoE block of a Hugging Face model (the module holding the router and the
fused experts) by its own layer. deepshard keeps the block, its class, its children and its parameter names
(so checkpoints, ``state_dict`` and transformers' own ``isinstance`` checks see the model unchanged), and
re-classes it as a subclass of both :class:`AutoEPMoELayer` and its own class: ``isinstance(block,
AutoEPMoELayer)`` finds the replaced blocks as it finds DeepSpeed's, and the layer carries what DeepSpeed's
carries (``router``, ``experts``, ``ep_group``, ``ep_group_name``, ``ep_size``, ``ep_rank``, ``num_experts``,
``num_local_experts``, ``moe_layer_id``, ``module_path``).

Its forward is one of two:

* the block calls its experts module (transformers 5: ``experts(hidden, top_k_index, top_k_weights)``): the
  block's own forward runs, its router decides, and the experts module's forward (replaced by
  :class:`deepshard.moe.autoep.ExpertParallelForward`) sends each route to the rank holding its expert;
* the block reads the fused weights itself (its experts module has no forward of its own, as in DeepSpeed's
  test models) and ``autoep_size`` > 1 (at 1 every expert is local and the block's own forward is kept): the
  layer routes as the ``mixtral`` preset routes (softmax over the router's logits, the
  top ``k``, their weights renormalised to sum to 1) and calls the experts module with the routes, so the
  same exchange runs. The activation is the experts module's ``act_fn`` where it has one, else SiLU (the
  gated SwiGLU experts of Mixtral, Qwen-MoE, OLMoE).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

__all__ = ["AutoEPMoELayer", "BlockRouting", "adopt_block", "block_routing", "INLINE_PRESETS"]

INLINE_PRESETS = (None, "mixtral")
"""``preset_model`` values whose routing the layer computes itself for blocks that do not call their experts
module (softmax, top-k, renormalised: Mixtral's rule)."""
ROUTER_NAMES = ("gate", "router")
TOP_K_NAMES = ("top_k", "num_experts_per_tok")


class AutoEPMoELayer(nn.Module):
    """A MoE block whose experts AutoEP split over expert-parallel ranks (module docstring). Instances are
    the model's own blocks, re-classed by :func:`adopt_block`; never built directly."""

    ep_group: Any
    ep_group_name: str
    ep_size: int
    ep_rank: int
    num_experts: int
    num_local_experts: int
    moe_layer_id: int
    module_path: str
    autoep_router_name: Optional[str]
    autoep_top_k: Optional[int]
    autoep_routes_inline: bool

    @property
    def router(self) -> nn.Module:
        """The block's router (its ``gate`` / ``router`` child): a dense parameter every rank holds."""
        if self.autoep_router_name is None:
            raise AttributeError(f"AutoEP layer {self.module_path} has no child named {' or '.join(ROUTER_NAMES)}")
        return getattr(self, self.autoep_router_name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.autoep_routes_inline:
            return super().forward(*args, **kwargs)
        return self._route(*args, **kwargs)

    def _route(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """Mixtral's routing, then the experts module's expert-parallel forward."""
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        logits = self.router(flat)
        scores = torch.softmax(logits.float(), dim=-1)
        weights, chosen = torch.topk(scores, k=int(self.autoep_top_k or 0), dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(flat.dtype)
        experts: nn.Module = getattr(self, "experts")
        return experts(flat, chosen, weights).reshape(shape)


def _child_name(module: nn.Module, names: tuple[str, ...]) -> Optional[str]:
    return next((n for n in names if isinstance(getattr(module, n, None), nn.Module)), None)


def _top_k(block: nn.Module, experts: nn.Module) -> Optional[int]:
    for owner in (block, experts, getattr(block, "config", None)):
        for name in TOP_K_NAMES:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


@functools.lru_cache(maxsize=None)
def _layer_class(cls: type) -> type:
    """The class ``AutoEPMoELayer`` + ``cls`` (named after ``cls``), one for all the blocks of class ``cls``."""
    if issubclass(cls, AutoEPMoELayer):
        return cls
    return type(f"AutoEP{cls.__name__}", (AutoEPMoELayer, cls), {"__module__": __name__,
                                                                 "__doc__": AutoEPMoELayer.__doc__})


@dataclass(frozen=True)
class BlockRouting:
    """How the layer made of one MoE block routes: ``inline`` (the layer routes, see the module docstring), the
    name of the block's router child and its top-k (None where the block has none)."""

    inline: bool
    router_name: Optional[str]
    top_k: Optional[int]


def block_routing(block: nn.Module, experts_name: str, *, module_path: str, ep_size: int,
                  preset: Optional[str]) -> BlockRouting:
    """How the MoE ``block`` (holding the fused experts as its child ``experts_name``) is routed at ``ep_size``
    expert-parallel ranks; raises where the block reads its experts itself and its routing cannot be known.
    Changes nothing, so every block is checked before any is adopted."""
    experts = getattr(block, experts_name)
    # no forward of its own: the block indexes the fused weights, which at ep_size 1 are whole (its own forward
    # is then exact); past 1 the layer routes
    inline = type(experts).forward is nn.Module.forward and int(ep_size) > 1
    router_name = _child_name(block, ROUTER_NAMES)
    top_k = _top_k(block, experts)
    if inline:
        if preset not in INLINE_PRESETS:
            raise NotImplementedError(
                f"AutoEP: the MoE block {module_path} ({type(block).__name__}) reads its experts' weights itself, "
                f"so deepshard routes for it, and it knows the routing of preset_model 'mixtral' only, not "
                f"{preset!r}; set expert_parallel.preset_model to 'mixtral' if the block routes as Mixtral does "
                "(softmax, top-k, renormalised), or give the experts module a forward(hidden, top_k_index, "
                "top_k_weights) as transformers 5 does")
        if router_name is None or top_k is None:
            raise ValueError(f"AutoEP: the MoE block {module_path} ({type(block).__name__}) reads its experts' "
                             f"weights itself and has no router child ({' / '.join(ROUTER_NAMES)}) or no top-k "
                             f"attribute ({' / '.join(TOP_K_NAMES)}) to route with; add them to the block or "
                             "turn expert_parallel off for this model")
    return BlockRouting(inline, router_name, top_k)


def adopt_block(block: nn.Module, routing: BlockRouting, *, module_path: str, moe_layer_id: int, num_experts: int,
                groups: Any) -> AutoEPMoELayer:
    """Re-class the MoE ``block`` as an :class:`AutoEPMoELayer` of the expert-parallel ``groups``
    (``topology.ExpertGroups``), routing as :func:`block_routing` found."""
    block.__class__ = _layer_class(type(block))
    values = dict(ep_group=groups.ep.group, ep_group_name=groups.name, ep_size=int(groups.ep_size),
                  ep_rank=int(groups.ep_rank), num_experts=int(num_experts),
                  num_local_experts=int(num_experts) // int(groups.ep_size), moe_layer_id=int(moe_layer_id),
                  module_path=module_path, autoep_router_name=routing.router_name, autoep_top_k=routing.top_k,
                  autoep_routes_inline=routing.inline)
    for key, value in values.items():
        object.__setattr__(block, key, value)  # plain attributes: never registered as children
    return block  # type: ignore[return-value]
