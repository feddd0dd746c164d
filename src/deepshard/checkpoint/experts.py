"""The whole model's state dict from a run whose MoE layers split their experts over expert-parallel ranks:
each rank holds some experts under local ids (``...deepspeed_experts.<i>...``); the state dict a user saves
(``save_16bit_model``) holds every expert under its global id, as a model holding them all would."""
from __future__ import annotations

import re
from typing import Any, Callable

import torch
from torch import nn

from deepshard.comm.group import CommGroup
from deepshard.placement import expert_of, saved_name, saved_slice

_EXPERT_ID = re.compile(r"(?:^|\.)deepspeed_experts\.(\d+)(?:\.|$)")


def whole_state_dict(state: dict[str, torch.Tensor], module: nn.Module, world: CommGroup) -> dict[str, torch.Tensor]:
    """``state`` (this rank's ``module.state_dict()``) as the whole model's on the world's rank 0: every
    layer's experts from the ranks holding them, under their global ids (AutoEP's slices of fused experts put
    back together), in the order a model holding every expert lists them (collective over ``world``; the
    other ranks get their own part, renamed)."""
    import torch.distributed as dist

    experts_here = {n: p for n, p in module.named_parameters(remove_duplicate=False) if expert_of(p) is not None}
    if not experts_here:  # (the same answer on every rank: the layers' ep sizes are the model's)
        return state
    mine = {saved_name(experts_here[k], k) if k in experts_here else k: v for k, v in state.items()}
    pieces = [(saved_name(p, k), saved_slice(p), state[k]) for k, p in experts_here.items() if k in state]
    parts: list[Any] = [pieces]
    if world.size > 1:
        parts = [None] * world.size if world.rank == 0 else []
        dist.gather_object(pieces, parts if world.rank == 0 else None, dst=world.peers[0], group=world.group)
    for part in parts:
        for name, (offset, shape), value in part:
            if shape is None:
                mine[name] = value
                continue
            if tuple(mine[name].shape) != tuple(shape):
                mine[name] = torch.zeros(shape, dtype=value.dtype)
            mine[name].reshape(-1)[offset:offset + value.numel()] = value.reshape(-1).cpu()
    return {k: mine[k] for k in sorted(mine, key=_model_order(list(mine)))}


def _model_order(names: list[str]) -> Callable[[str], tuple[int, int, int]]:
    """Sort key: dense names where they are; a layer's experts together, by global id, each expert's
    tensors in their own order."""
    first: dict[str, int] = {}
    tails: dict[str, list[str]] = {}
    for i, name in enumerate(names):
        m = _EXPERT_ID.search(name)
        if m is not None:
            head, tail = name[:m.start(1)], name[m.end(1):]
            first.setdefault(head, i)
            if tail not in tails.setdefault(head, []):
                tails[head].append(tail)
    where = {name: i for i, name in enumerate(names)}

    def key(name: str) -> tuple[int, int, int]:
        m = _EXPERT_ID.search(name)
        if m is None:
            return (where[name], 0, 0)
        head, tail = name[:m.start(1)], name[m.end(1):]
        return (first[head], int(m.group(1)), tails[head].index(tail))

    return key
