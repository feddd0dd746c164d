"""The plain data a ZeRO strategy and ``checkpoint/`` hand each other: no files, no formats.

Saving, a strategy describes what this rank holds as a :class:`ShardState` (its :class:`FragmentRecord`
per owned slice of a parameter, its optimizer's hyperparameters, the buffers and frozen weights it is
the writer of); ``checkpoint/`` decides the files. Loading, ``checkpoint/`` reads any format it knows
(deepshard's fragments, DeepSpeed's directories) into one :class:`FullState` (whole tensors by name) and
the strategy takes the slices it owns. The two sides meet here, below both: a strategy imports no
checkpoint type and ``checkpoint/`` no strategy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


@dataclass
class FragmentRecord:
    """One fragment to save: ``value`` is the 1-D fp32 slice ``[start, start + numel)`` of parameter
    ``name`` (flattened); ``state`` its optimizer state."""

    name: str
    start: int
    numel: int
    value: torch.Tensor
    state: dict[str, Any] = field(default_factory=dict)


@dataclass
class ShardState:
    """What one rank's strategy hands ``checkpoint/`` to save."""

    records: list[FragmentRecord]
    """The slices of trainable parameters this rank writes (fp32 values and optimizer state)."""
    param_groups: Optional[list[dict[str, Any]]]
    """The optimizer's groups (:func:`export_param_groups`), or None without an optimizer."""
    module_extra: Optional[dict[str, torch.Tensor]]
    """Buffers and frozen parameters when this rank is their writer (the first rank of its replica
    group), else None."""
    meta: dict[str, Any]
    """What the strategy says about itself (``zero_stage``, ``dp_world_size``)."""


@dataclass
class FullState:
    """A checkpoint reassembled per parameter name, whatever wrote it."""

    params: dict[str, torch.Tensor]
    optim: dict[str, dict[str, Any]]
    optim_kinds: dict[str, dict[str, str]]
    """Per name and state key: ``elementwise`` (shaped like the parameter), ``scalar`` (0-d tensor),
    ``whole`` (a non-elementwise tensor), ``python`` (a plain value)."""
    param_groups: list[dict[str, Any]] | None
    module_extra: dict[str, torch.Tensor]
    aliases: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    meta: dict[str, Any]

    def has(self, name: str) -> bool:
        """Whether the state-dict name ``name`` has a value here (a tied weight's alias counts)."""
        return self.aliases.get(name, name) in self.params or name in self.module_extra


def _numel(shape: Any) -> int:
    return int(torch.Size(shape).numel())


def slice_state(full: FullState, name: str, start: int, numel: int, like: torch.Tensor) -> dict[str, Any]:
    """The optimizer state of fragment ``[start, start+numel)`` of ``name``, cast like ``like``."""
    out: dict[str, Any] = {}
    for key, value in full.optim.get(name, {}).items():
        kind = full.optim_kinds[name][key]
        if kind == "elementwise":
            piece = value.reshape(-1)[start:start + numel]
            if numel == like.numel() and like.dim() > 1:  # a whole parameter (or a saved slice of one) keeps its shape
                piece = piece.view(like.shape)
            out[key] = piece.to(device=like.device, dtype=like.dtype if piece.is_floating_point() else piece.dtype
                                ).clone()
        elif kind == "whole":
            if numel != _numel(full.shapes[name]):
                raise ValueError(f"optimizer state '{key}' of '{name}' is not elementwise and cannot be split "
                                 "across processes; load it with ZeRO stage 0")
            out[key] = value.to(like.device).clone()
        else:
            out[key] = value.clone() if torch.is_tensor(value) else value
    return out


def restore_param_groups(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]] | None,
                         identify: Callable[[torch.Tensor], set[str]] | None = None) -> None:
    """Restore hyperparameters group by group (lr, betas, weight_decay, ...). With another number of groups
    than the checkpoint's (MoE layers at other expert-parallel sizes get other expert groups), each group
    takes the hyperparameters of the saved group that lists most of its parameters, ``identify(p)`` giving
    the names a parameter may be saved under (its structural keys ``name`` and ``moe`` stay its own)."""
    if saved is None:
        return
    if len(saved) == len(optimizer.param_groups):
        pairs = list(zip(optimizer.param_groups, saved))
        keep: tuple[str, ...] = ()
    elif identify is not None:
        pairs = [(group, _best_saved_group(group, saved, identify)) for group in optimizer.param_groups]
        keep = ("name", "moe")
    else:
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved)} param groups but this optimizer has "
            f"{len(optimizer.param_groups)}; build the optimizer with the same groups, or load with "
            "load_optimizer_states=False to restore the weights only")
    for group, saved_group in pairs:
        tuples = set(saved_group.get("__tuples__", []))
        for key, value in saved_group.items():
            if key in ("params", "__tuples__") or key in keep:
                continue
            group[key] = tuple(value) if key in tuples else value


def _best_saved_group(group: dict[str, Any], saved: list[dict[str, Any]],
                      identify: Callable[[torch.Tensor], set[str]]) -> dict[str, Any]:
    names = set().union(*(identify(p) for p in group["params"])) if group["params"] else set()
    overlap = [len(names & set(s.get("params", []))) for s in saved]
    if not overlap or max(overlap) == 0:
        raise ValueError(f"the checkpoint's {len(saved)} optimizer param groups list none of the parameters of a "
                         f"group of this optimizer ({len(group['params'])} parameters); build the optimizer with "
                         "the checkpoint's groups, or load with load_optimizer_states=False")
    return saved[overlap.index(max(overlap))]


def export_param_groups(optimizer: torch.optim.Optimizer, name_of: dict[int, str]) -> list[dict[str, Any]]:
    """The optimizer's groups as plain data: hyperparameters (tuples as lists, their keys in
    ``__tuples__``) and ``params``, the names of the group's parameters (``name_of``: by ``id``)."""
    groups = []
    for group in optimizer.param_groups:
        g = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        g["params"] = [name_of[id(p)] for p in group["params"] if id(p) in name_of]
        g["__tuples__"] = [k for k, v in group.items() if isinstance(v, tuple)]
        groups.append(g)
    return groups
