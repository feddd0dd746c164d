"""What ``deepshard convert --to deepspeed`` writes differently for a mixture-of-experts model (the layout
``deepspeed_format/experts.py`` reads): each expert in its own ``layer_<L>_expert_<G>`` file under its global id,
the model states without expert tensors but with ``num_experts``, and at ZeRO 1/2 the MoE optimizer group
(``ep_size_<P>``, ``moe``) partitioned over each expert-parallel rank's expert-data-parallel ranks under that
rank's local expert ids, as DeepSpeed's engine holds them.

deepshard's checkpoints name every expert by its global id, so the target ``ep_size`` is free: the converted
directory is for a DeepSpeed job whose MoE layers are built with that ``ep_size``.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepshard.checkpoint.deepspeed_format.experts import EXPERT_ID, MoeLayer, global_name
from deepshard.checkpoint.deepspeed_format.pickle_names import save_pt


@dataclass(frozen=True)
class FlatView:
    """One flat optimizer vector as one rank's file holds it."""

    names: list[str]
    """The names in the file (an expert's: its local id on this rank)."""
    source: list[str]
    """The same tensors' names in the deepshard checkpoint (global ids)."""
    parts: int
    """How many ranks share the vector (the data-parallel size; an MoE group: the expert-data-parallel size)."""
    part: int
    """This rank's share."""


def find_layers(names: list[str]) -> list[MoeLayer]:
    """The MoE layers of a deepshard checkpoint (its parameter names, in model order): each prefix holding
    ``...deepspeed_experts.<G>...`` names, numbered in order of first appearance."""
    prefixes: "OrderedDict[str, set[int]]" = OrderedDict()
    tails: dict[str, list[str]] = {}
    for name in names:
        m = EXPERT_ID.match(name)
        if m is None:
            continue
        prefixes.setdefault(m.group(1), set()).add(int(m.group(2)))
        if m.group(2) == "0":
            tails.setdefault(m.group(1), []).append(m.group(3))
    return [MoeLayer(i, len(ids), prefix, tuple(tails.get(prefix, ())))
            for i, (prefix, ids) in enumerate(prefixes.items())]


def is_expert(name: str, layers: list[MoeLayer]) -> bool:
    m = EXPERT_ID.match(name)
    return m is not None and any(layer.prefix == m.group(1) for layer in layers)


def check_target(layers: list[MoeLayer], ep: int, dp: int, stage: int) -> None:
    """Refuse a target DeepSpeed cannot run, saying why."""
    if stage == 3:
        raise ValueError("--stage 3: DeepSpeed 0.19.8 refuses native MoE layers under ZeRO-3 at initialize; convert "
                         "to --stage 1 or 2")
    if ep < 1 or dp % ep:
        raise ValueError(f"--ep {ep} --dp {dp}: the data-parallel size must be a multiple of ep_size")
    bad = [(layer.prefix, layer.num_experts) for layer in layers if layer.num_experts % ep]
    if bad:
        raise ValueError(f"--ep {ep}: these MoE layers' expert counts do not divide by it: {bad}")


def expert_view(names: list[str], layers: list[MoeLayer], ep: int, dp: int, rank: int) -> FlatView:
    """The MoE group ``names`` (global ids) as data-parallel rank ``rank`` holds it at ``ep``: expert-parallel
    rank ``rank % ep``'s experts under local ids, partitioned over its ``dp / ep`` expert-data-parallel ranks."""
    share, e = divmod(rank, ep)
    local = [f"{layer.prefix}{i}{tail}" for layer in layers for i in range(layer.num_experts // ep)
             for tail in layer.tails]
    source = [global_name(n, layers, e, ep) for n in local]
    missing = sorted(set(source) - set(names))
    if missing:
        raise ValueError(f"the checkpoint lacks expert tensors {missing[:4]} of its MoE optimizer group")
    return FlatView(local, source, dp // ep, share)


def write_expert_files(params: dict[str, torch.Tensor], layers: list[MoeLayer], dtype: torch.dtype,
                       staging: Path) -> None:
    """``layer_<L>_expert_<G>_mp_rank_00_model_states.pt``: each expert's tensors under its global id."""
    for layer in layers:
        for g in range(layer.num_experts):
            state = OrderedDict((f"{layer.prefix}{g}{tail}", params[f"{layer.prefix}{g}{tail}"].to(dtype).clone())
                                for tail in layer.tails)
            save_pt(state, staging / f"layer_{layer.index}_expert_{g}_mp_rank_00_model_states.pt")


def model_state_extras(layers: list[MoeLayer]) -> dict[str, Any]:
    return {"num_experts": [layer.num_experts for layer in layers], "ds_autoep_layers": None}


__all__ = ["FlatView", "check_target", "expert_view", "find_layers", "is_expert", "model_state_extras",
           "write_expert_files"]
