"""Which parameters ZeRO-3 gathers together: its parameter groups.

By default each module's own parameters form a group (trainable and frozen ones apart): a transformer
block is then half a dozen gathers in forward, as many in backward and as many reduce-scatters, each
paying a collective's fixed cost (the hooks, the rendezvous, the allocation) however few bytes it moves.
On a small model those fixed costs, not the bytes, set the step time.

``stage3_min_gather_size`` (elements; default 6,553,600, DDP's 25 MB bucket of fp32; 0: off) coalesces
them, as FSDP2 gathers each ``fully_shard`` unit's parameters at once: a module whose whole subtree holds
at most that many elements (and has submodules with parameters, all reduced over the same ranks: a block
holding experts of an expert-parallel MoE layer is not one) becomes one *unit*, its subtree's parameters
one group. The unit's
forward gathers the group once; its submodules keep their hooks and find it gathered (so one called on
its own still gathers what it needs), and its gradients are reduce-scattered in one collective once
backward has produced all of them. The root module is never a unit (the whole model gathered at once is
stage 0's memory).
"""
from __future__ import annotations

from typing import Callable, Hashable, Optional

import torch

from deepshard.placement import saved_name

Discovered = list[tuple[str, list[torch.nn.Parameter], list[str]]]


def discover_groups(module: torch.nn.Module, min_gather: int = 0,
                    domain: Optional[Callable[[torch.nn.Parameter], Hashable]] = None) -> tuple[Discovered, set[int]]:
    """(module name, params, param names) per group, each parameter once, and the ids of the unit modules
    (``min_gather``: a module whose subtree holds at most that many parameter elements is one group;
    ``domain(p)``: the ranks ``p`` is sharded and reduced over, which a group never mixes; default: one)."""
    names = {id(p): saved_name(p, n) for n, p in module.named_parameters()}  # experts: their global names
    units = _units(module, min_gather, domain or (lambda p: 0)) if min_gather > 0 else {}
    seen: set[int] = set()
    out: Discovered = []
    inside: set[int] = set()  # submodules of a unit: their parameters are the unit's
    for mod_name, m in module.named_modules():
        if id(m) in inside:
            continue
        if id(m) in units:
            inside.update(id(d) for d in m.modules() if d is not m)
            candidates = list(m.parameters())
        else:
            candidates = list(m.parameters(recurse=False))
        own = [p for p in candidates if id(p) not in seen]
        seen.update(id(p) for p in own)
        for trainable in (True, False):
            ps = [p for p in own if p.requires_grad == trainable]
            if ps:
                out.append((mod_name or "<root>", ps, [names[id(p)] for p in ps]))
    return out, set(units)


def _units(module: torch.nn.Module, min_gather: int,
           domain: Callable[[torch.nn.Parameter], Hashable]) -> dict[int, torch.nn.Module]:
    """The outermost non-root modules whose subtree holds at most ``min_gather`` elements, more than one
    module with parameters (a lone module is a group already) and parameters of one domain only."""
    units: dict[int, torch.nn.Module] = {}
    covered: set[int] = set()
    for _, m in module.named_modules():
        if m is module or id(m) in covered:
            continue
        size = sum(int(getattr(p, "ds_numel", p.numel())) for p in m.parameters())
        holders = sum(1 for d in m.modules() if next(d.parameters(recurse=False), None) is not None)
        if 0 < size <= min_gather and holders > 1 and len({domain(p) for p in m.parameters()}) == 1:
            units[id(m)] = m
            covered.update(id(d) for d in m.modules())
    return units
