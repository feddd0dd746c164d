"""DeepSpeed's checkpoint layout for mixture-of-experts models, read as whole tensors under global expert ids.

DeepSpeed writes each expert of each MoE layer to ``layer_<L>_expert_<G>_mp_rank_<MM>_model_states.pt`` (its
tensors keyed with the global id ``G``), keeps the expert keys out of ``mp_rank_<MM>_model_states.pt`` and records
there ``num_experts`` (one entry per MoE layer, in module order). Its optimizer state, however, is each rank's:
a rank holds ``num_experts / ep_size`` experts of a layer under *local* ids ``0..n-1``, and

* without ZeRO, ``expp_rank_<R>_mp_rank_<MM>_optim_states.pt`` holds expert-parallel rank ``R``'s whole
  ``optimizer.state_dict()`` (parameters numbered group by group: dense groups, then one ``ep_size_<P>`` group
  per expert-parallel size, marked ``moe``);
* under ZeRO 1/2 an ``ep_size_<P>`` group is partitioned over its expert-data-parallel group (the ranks
  ``e, e + P, e + 2P, ...`` of expert-parallel rank ``e``), and ``param_shapes`` (written by rank 0) names rank
  0's local experts.

Local expert ``i`` of expert-parallel rank ``e`` of a layer split ``P`` ways is global expert ``e * E / P + i``.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from deepshard.checkpoint.deepspeed_format.safe_load import load_pt
from deepshard.checkpoint.io import CheckpointError
from deepshard.shard_state import FullState

EXPERT_OPTIM = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
EXPERT_ID = re.compile(r"^(.*?\.?deepspeed_experts\.)(\d+)(\..+)$")
GROUP_NAME = re.compile(r"^ep_size_(\d+)$")


@dataclass(frozen=True)
class MoeLayer:
    """One MoE layer as the checkpoint holds it."""

    index: int
    num_experts: int
    prefix: str
    """``<module path>.deepspeed_moe.experts.deepspeed_experts.``"""
    tails: tuple[str, ...]
    """Each expert's tensor names after its id (``.0.weight``...), in the module's order."""


def moe_layers(tag_dir: Path, first: dict[str, Any], mp_rank: int = 0) -> list[MoeLayer]:
    """The MoE layers of a DeepSpeed checkpoint ([] for a dense one), from ``num_experts`` and each layer's first
    expert file."""
    counts = first.get("num_experts")
    if counts is None:
        return []
    if not isinstance(counts, (list, tuple)):
        raise CheckpointError(f"{tag_dir}: num_experts is {counts!r}, not a list: DeepSpeed's old MoE layout "
                              "(expert_<G>_mp_rank_XX_model_states.pt, before layer ids) is not read; resave it with a "
                              "DeepSpeed version newer than 0.6")
    layers = []
    for index, count in enumerate(int(c) for c in counts):
        path = tag_dir / f"layer_{index}_expert_0_mp_rank_{mp_rank:02d}_model_states.pt"
        if not path.is_file():
            raise CheckpointError(f"DeepSpeed MoE checkpoint file {path} does not exist: the model states list "
                                  f"{len(counts)} MoE layers; copy the whole tag directory")
        keys = list(load_pt(path))
        matches = [EXPERT_ID.match(k) for k in keys]
        if not keys or any(m is None or m.group(2) != "0" for m in matches):
            raise CheckpointError(f"{path}: expected tensors named '...deepspeed_experts.0.<name>', found {keys[:4]}")
        layers.append(MoeLayer(index, count, matches[0].group(1), tuple(m.group(3) for m in matches)))
    return layers


def expert_weights(tag_dir: Path, layers: list[MoeLayer], mp_rank: int = 0) -> dict[str, torch.Tensor]:
    """Every expert's tensors under its global id, layer by layer."""
    out: dict[str, torch.Tensor] = {}
    for layer in layers:
        for g in range(layer.num_experts):
            path = tag_dir / f"layer_{layer.index}_expert_{g}_mp_rank_{mp_rank:02d}_model_states.pt"
            if not path.is_file():
                raise CheckpointError(f"DeepSpeed MoE checkpoint file {path} does not exist: layer {layer.index} has "
                                      f"{layer.num_experts} experts; copy the whole tag directory")
            out.update(load_pt(path))
    return out


def global_name(name: str, layers: list[MoeLayer], ep_rank: int, ep_size: int) -> str:
    """``name`` (a local expert's tensor on expert-parallel rank ``ep_rank`` of ``ep_size``) under its global id;
    a dense name unchanged."""
    m = EXPERT_ID.match(name)
    layer = next((x for x in layers if m is not None and x.prefix == m.group(1)), None)
    if layer is None:
        return name
    return f"{m.group(1)}{ep_rank * (layer.num_experts // ep_size) + int(m.group(2))}{m.group(3)}"


def group_ep_size(group: dict[str, Any]) -> Optional[int]:
    """The expert-parallel size of an optimizer group DeepSpeed marked ``moe`` (None: a dense group)."""
    if not group.get("moe"):
        return None
    m = GROUP_NAME.match(str(group.get("name", "")))
    if m is None:
        raise CheckpointError(f"an optimizer group is marked moe but named {group.get('name')!r}, not 'ep_size_<P>'")
    return int(m.group(1))


def local_names(layers: list[MoeLayer], sizes: dict[int, int], ep_size: int) -> list[str]:
    """The local expert tensor names a rank lists in its ``ep_size_<ep_size>`` group, in module order
    (``sizes``: each layer's expert-parallel size)."""
    return [f"{layer.prefix}{i}{tail}" for layer in layers if sizes[layer.index] == ep_size
            for i in range(layer.num_experts // ep_size) for tail in layer.tails]


def layer_ep_sizes(layers: list[MoeLayer], groups: list[tuple[int, int]], where: Path) -> dict[int, int]:
    """Each layer's expert-parallel size, from the optimizer's MoE groups (``(P, number of parameters)``): the
    one assignment of sizes to layers whose local expert counts fill every group exactly."""
    sizes = sorted({p for p, _ in groups})
    wanted = {p: sum(n for q, n in groups if q == p) for p in sizes}
    if len(sizes) == 1:  # the usual case: every layer split the same way
        return {layer.index: sizes[0] for layer in layers}
    if len(sizes) ** len(layers) > 100_000:
        raise CheckpointError(f"{where}: {len(layers)} MoE layers over {len(sizes)} expert-parallel sizes are too many "
                              "to tell each layer's size from the optimizer groups; resave with ZeRO 1 or 2")
    found = []
    for choice in itertools.product(sizes, repeat=len(layers)):
        if any(layer.num_experts % p for layer, p in zip(layers, choice)):
            continue
        filled = {p: sum(layer.num_experts // p * len(layer.tails) for layer, q in zip(layers, choice) if q == p)
                  for p in sizes}
        if filled == wanted:
            found.append(choice)
    if len(found) != 1:
        raise CheckpointError(f"{where}: cannot tell each MoE layer's ep_size from the optimizer groups {groups} "
                              f"({'several' if found else 'no'} assignments fit the layers' expert counts "
                              f"{[x.num_experts for x in layers]})")
    return {layer.index: p for layer, p in zip(layers, found[0])}


def read_stage0_optimizer(tag_dir: Path, layers: list[MoeLayer], dense: list[str], full: FullState,
                          mp_rank: int = 0) -> None:
    """Without ZeRO: every expert-parallel rank's ``optimizer.state_dict()`` (``expp_rank_<R>`` files) into
    ``full`` by name: dense groups (``dense``: their parameters in module order) from rank 0, each ``ep_size_<P>``
    group from ranks ``0..P-1`` under global expert ids."""
    files = sorted((int(m.group(1)), p) for p in tag_dir.iterdir()
                   if (m := EXPERT_OPTIM.match(p.name)) and int(m.group(2)) == mp_rank)
    if not files:
        return  # saved without optimizer state
    if [r for r, _ in files] != list(range(len(files))):
        raise CheckpointError(f"{tag_dir}: expp_rank optimizer files of ranks {[r for r, _ in files]}, expected 0.."
                              f"{len(files) - 1}; copy the whole tag directory")
    osds = [load_pt(p)["optimizer"] for _, p in files]
    moe_groups = [(p, len(g["params"])) for g in osds[0]["param_groups"] if (p := group_ep_size(g))]
    sizes = layer_ep_sizes(layers, moe_groups, files[0][1]) if moe_groups else {}
    full.param_groups = [_hparams(g) for g in osds[0]["param_groups"]]
    for rank, osd in enumerate(osds):
        remaining = iter(dense)
        for g, group in enumerate(osd["param_groups"]):
            size = group_ep_size(group)
            if (size is None and rank > 0) or (size is not None and rank >= size):
                continue  # the dense groups are every rank's; ranks past P repeat ranks R % P
            names = ([next(remaining, "") for _ in group["params"]] if size is None else
                     [global_name(n, layers, rank, size) for n in local_names(layers, sizes, size)])
            if len(names) != len(group["params"]) or "" in names:
                raise CheckpointError(f"{files[rank][1]}: optimizer group {g} ({group.get('name')!r}) lists "
                                      f"{len(group['params'])} parameters, the model states {len(names)}")
            full.param_groups[g]["params"] += names
            for index, name in zip(group["params"], names):
                if index not in osd["state"]:
                    continue
                state = osd["state"][index]
                full.optim[name] = {k: (v.reshape(-1).clone() if torch.is_tensor(v) and v.dim() > 0 else v)
                                    for k, v in state.items()}
                full.optim_kinds[name] = {k: ("elementwise" if torch.is_tensor(v) and v.dim() > 0 else "scalar")
                                          for k, v in state.items()}


def _hparams(group: dict[str, Any]) -> dict[str, Any]:
    out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
    out["__tuples__"] = [k for k, v in group.items() if isinstance(v, tuple)]
    out["params"] = []
    return out


__all__ = ["EXPERT_OPTIM", "MoeLayer", "expert_weights", "global_name", "group_ep_size", "layer_ep_sizes",
           "local_names", "moe_layers", "read_stage0_optimizer"]
