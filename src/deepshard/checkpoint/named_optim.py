"""Optimizer state keyed by parameter *name* rather than by position.

torch's ``Optimizer.state_dict()`` numbers parameters by their position in the param groups, which
changes with the layout (masters vs model params, partitions, stage). Keyed by the parameter's name, the
same checkpoint loads into any stage and any process count.
"""
from __future__ import annotations

from typing import Any

import torch

TENSOR_SEP = "::"


def export_optimizer_state(optimizer: torch.optim.Optimizer, name_of: dict[int, str]
                           ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Return (tensors ``{name::key: tensor}``, JSON metadata with param groups and scalar state)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for p, state in optimizer.state.items():
        name = name_of.get(id(p))
        if name is None:
            continue
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{name}{TENSOR_SEP}{key}"] = value.detach()
            else:
                scalars.setdefault(name, {})[key] = value
    groups = []
    for group in optimizer.param_groups:
        g = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        g["params"] = [name_of[id(p)] for p in group["params"] if id(p) in name_of]
        g["__tuples__"] = [k for k, v in group.items() if isinstance(v, tuple)]
        groups.append(g)
    return tensors, {"param_groups": groups, "scalars": scalars}


def import_optimizer_state(optimizer: torch.optim.Optimizer, by_name: dict[str, torch.nn.Parameter] | dict,
                           tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                           slicer: Any = None) -> None:
    """Load name-keyed state into ``optimizer`` whose tensors are ``by_name[name]``.

    ``slicer(name, full_tensor) -> tensor`` lets a sharded strategy keep only its part of each state.
    Hyperparameters of the param groups are restored group by group (the group count must match).
    """
    saved_groups = meta["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved_groups)} param groups but this optimizer has "
            f"{len(optimizer.param_groups)}; build the optimizer with the same groups, or load with "
            "load_optimizer_states=False to restore the weights only")
    for group, saved in zip(optimizer.param_groups, saved_groups):
        tuples = set(saved.get("__tuples__", []))
        for key, value in saved.items():
            if key in ("params", "__tuples__"):
                continue
            group[key] = tuple(value) if key in tuples else value
    optimizer.state.clear()
    per_param: dict[str, dict[str, Any]] = {}
    for flat_key, value in tensors.items():
        name, key = flat_key.rsplit(TENSOR_SEP, 1)
        per_param.setdefault(name, {})[key] = value
    for name, scalars in meta.get("scalars", {}).items():
        per_param.setdefault(name, {}).update(scalars)
    for name, state in per_param.items():
        target = by_name.get(name)
        if target is None:
            continue
        restored: dict[str, Any] = {}
        for key, value in state.items():
            if torch.is_tensor(value):
                if slicer is not None and value.dim() > 0:
                    value = slicer(name, value)
                if value.dim() > 0:  # 0-d tensors (Adam's 'step') stay where torch expects them
                    dtype = target.dtype if value.is_floating_point() else value.dtype
                    value = value.to(device=target.device, dtype=dtype)
            restored[key] = value
        optimizer.state[target] = restored
