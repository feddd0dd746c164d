"""A DeepSpeed tag directory as deepshard's :class:`FullState` (whole fp32 tensors and optimizer state by
parameter name) plus the engine's counters: what every deepshard strategy loads from, on any layout.

The fp32 master weights come from the optimizer files' flat partitions (``single_partition_of_fp32_groups``
at ZeRO 1-2, ``fp32_flat_groups`` at ZeRO-3), cut back into tensors with ``param_shapes``; Adam's
``exp_avg``/``exp_avg_sq`` are cut the same way; ``step`` is per parameter group. Buffers and frozen
weights come from the model-states files. Pipeline checkpoints hold one model-states and optimizer set
per stage (``mp_rank_<stage>``): their names are the whole model's, so stages read together give the
whole model.

With a :class:`~deepshard.checkpoint.share.LoadShare` (a ZeRO 1-3 strategy loading only its own ranges),
only the optimizer files holding those ranges are read (``share_files.py``); ``load`` reads one file (a
reader passes one that keeps what the engine record already read, so no file is read twice).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

import deepshard.checkpoint.deepspeed_format.detect as detect
import deepshard.checkpoint.deepspeed_format.experts as moe
from deepshard.checkpoint.deepspeed_format.allowlist import DeepSpeedRecord, DynamicLossScalerRecord
from deepshard.checkpoint.deepspeed_format.flat import numel_of, split_zero12, split_zero3
from deepshard.checkpoint.deepspeed_format.safe_load import load_pt
from deepshard.checkpoint.deepspeed_format.share_files import (estimated_sizes, zero3_ranks, zero12_ranks,
                                                                zeros_like_file)
from deepshard.checkpoint.io import CheckpointError
from deepshard.checkpoint.share import LoadShare
from deepshard.shard_state import FullState

ENGINE_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
               "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
               "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
               "checkpoint_parallel_dimensions", "universal_checkpoint_info", "num_experts", "ds_autoep_layers"}


@dataclass
class EngineRecord:
    """What a DeepSpeed model-states file says about the engine (besides the model)."""

    global_steps: int
    global_samples: int
    skipped_steps: int
    lr_scheduler: dict[str, Any] | None
    client_state: dict[str, Any]
    loss_scaler: dict[str, Any]
    zero_stage: int
    dp_world_size: int
    ds_config: dict[str, Any] = field(default_factory=dict)


Loader = Callable[[Path], Any]


def read_engine_record(tag_dir: Path, load: Loader = load_pt, rank: int = 0, read: Sequence[Path] = ()) -> EngineRecord:
    """Counters, LR scheduler, loss scaler and client state (from the first model-states file and one
    optimizer file: every rank's holds them; the first of ``read``, the files this load read already, else
    that of data-parallel rank ``rank`` modulo the saved data-parallel size)."""
    mp_rank = _first_mp_rank(tag_dir)
    first = load(detect.model_state_files(tag_dir, mp_rank)[0])
    scaler: dict[str, Any] = {"kind": "static", "scale": 1.0}
    stage = 0
    dp = int(first.get("dp_world_size", 1) or 1)
    done = [p for p in read if (m := detect.OPTIM_STATES.match(p.name)) and int(m.group(3)) == mp_rank]
    optim_path = done[0] if done else _optim_path(tag_dir, rank % dp, mp_rank) or _optim_path(tag_dir, 0, mp_rank)
    if optim_path is not None:
        osd = load(optim_path)["optimizer_state_dict"]
        stage = int(osd.get("zero_stage", 0))
        scaler = loss_scaler_state(osd.get("loss_scaler"))
    return EngineRecord(
        global_steps=int(first.get("global_steps", 0)), global_samples=int(first.get("global_samples", 0)),
        skipped_steps=int(first.get("skipped_steps", 0)), lr_scheduler=first.get("lr_scheduler"),
        client_state={k: v for k, v in first.items() if k not in ENGINE_KEYS}, loss_scaler=scaler,
        zero_stage=stage, dp_world_size=int(first.get("dp_world_size", 1)), ds_config=first.get("ds_config") or {})


def _first_mp_rank(tag_dir: Path) -> int:
    ranks = detect.mp_ranks(tag_dir)
    if not ranks:
        raise CheckpointError(f"DeepSpeed checkpoint file {tag_dir / 'mp_rank_00_model_states.pt'} does not exist "
                              "(nor a zero_pp_rank_*_mp_rank_00_model_states.pt): the checkpoint is incomplete; "
                              "copy the whole tag directory")
    return ranks[0]


def loss_scaler_state(record: Any) -> dict[str, Any]:
    """DeepSpeed's loss scaler object -> deepshard's ``loss_scaler.state_dict()`` form."""
    if not isinstance(record, DeepSpeedRecord):
        return {"kind": "static", "scale": 1.0}
    f = record.fields()
    if isinstance(record, DynamicLossScalerRecord) or f.get("dynamic"):
        return {"kind": "dynamic", "scale": float(f.get("cur_scale", 1.0)), "iteration": int(f.get("cur_iter", 0)),
                "last_overflow_iteration": int(f.get("last_overflow_iter", -1)),
                "hysteresis_left": int(f.get("cur_hysteresis", f.get("delayed_shift", 2)))}
    return {"kind": "static", "scale": float(f.get("cur_scale", 1.0))}


def _optim_path(tag_dir: Path, dp_rank: int, mp_rank: int) -> Path | None:
    for bf16 in (False, True):
        path = detect.optim_state_file(tag_dir, dp_rank, mp_rank, bf16)
        if path.is_file():
            return path
    return None


def read_full_state(tag_dir: Path, with_optimizer: bool = True, share: Optional[LoadShare] = None,
                    load: Loader = load_pt) -> FullState:
    """Every stage's (``mp_rank``'s) parameters, optimizer state and module extras, merged by name; with
    ``share``, the values outside its ranges are zeros (their files were not read)."""
    ranks = detect.mp_ranks(tag_dir) or [_first_mp_rank(tag_dir)]
    merged = FullState({}, {}, {}, None, {}, {}, {}, {})
    frozen: set[str] = set()
    for mp_rank in ranks:
        part = _read_slice(tag_dir, mp_rank, with_optimizer, len(ranks) > 1 or bool(detect.layer_files(tag_dir)),
                           share, load)
        for name in ("params", "optim", "optim_kinds", "module_extra", "aliases", "shapes", "meta"):
            getattr(merged, name).update(getattr(part, name))
        frozen |= set(part.meta.get("frozen_params", []))
        if part.param_groups is not None:
            merged.param_groups = _merge_groups(merged.param_groups, part.param_groups)
    # a pipeline stage's layer files include the other stages' trained weights: those are parameters
    merged.module_extra = {k: v for k, v in merged.module_extra.items() if k not in merged.params}
    merged.meta["frozen_params"] = [k for k in merged.module_extra if k in frozen]
    return merged


def _merge_groups(have: list[dict[str, Any]] | None, new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pipeline stages' groups, group by group: the hyperparameters agree, the names add up."""
    if have is None:
        return [dict(g) for g in new]
    for mine, theirs in zip(have, new):
        mine["params"] = list(mine["params"]) + [n for n in theirs["params"] if n not in mine["params"]]
    return have


def _read_slice(tag_dir: Path, mp_rank: int, with_optimizer: bool, pipeline: bool, share: Optional[LoadShare],
                load: Loader) -> FullState:
    model_files = detect.model_state_files(tag_dir, mp_rank)
    first = load(model_files[0])
    mp_world = int(first.get("mp_world_size", 1) or 1)
    if mp_world > 1 and not pipeline:
        raise CheckpointError(f"{model_files[0]}: a tensor-parallel DeepSpeed checkpoint (mp_world_size {mp_world}) "
                              "cannot be read yet; consolidate it with DeepSpeed's ds_to_universal first")
    dp = int(first.get("dp_world_size", 1) or 1)
    shapes_groups = first.get("param_shapes")
    layers = moe.moe_layers(tag_dir, first, mp_rank)
    if shapes_groups is None:
        return _read_stage0(tag_dir, first, model_files[0], pipeline, layers, mp_rank)
    optim_files = [_required_optim(tag_dir, r, mp_rank, dp) for r in range(dp)]
    osds = _read_optims(optim_files, None if layers else share, shapes_groups, load,
                        stage3=model_files[0].name.startswith("zero_pp_rank_"))
    stage = int(osds[0].get("zero_stage", 1))
    full = FullState({}, {}, {}, [], {}, dict(first.get("shared_params") or {}), {},
                     {"zero_stage": stage, "dp_world_size": dp})
    hparams = _base_state(osds[0], stage)["param_groups"]
    full.param_groups = [_group_hparams(group) for group in hparams]
    # ZeRO-3 cuts a large group into sub-groups (sub_group_size): each is one flat vector and one
    # optimizer parameter; ``params`` of a group lists its sub-groups
    owner = {int(i): gi for gi, group in enumerate(hparams) for i in group["params"]}
    for g, shapes in enumerate(shapes_groups):
        where = f"{tag_dir} (group {g})"
        ep_size = moe.group_ep_size(hparams[g]) if layers and stage < 3 else None
        values, states, named = _ep_group_values(osds, g, shapes, stage, where, with_optimizer, layers, ep_size)
        for name, flat in values.items():
            full.params[name] = flat.view(named[name])
            full.shapes[name] = named[name]
        for name, state in states.items():
            full.optim[name] = state
            full.optim_kinds[name] = {k: ("scalar" if v.dim() == 0 else "elementwise") for k, v in state.items()}
        full.param_groups[owner.get(g, g)]["params"] += list(named)
    full.module_extra.update(_module_extra(tag_dir, first, model_files, stage, pipeline, load))
    full.module_extra.update({k: v for k, v in moe.expert_weights(tag_dir, layers, mp_rank).items()
                              if k not in full.params})  # an expert's buffers
    buffers = set(first.get("buffer_names") or [])
    full.meta["frozen_params"] = [k for k in full.module_extra if k not in buffers]
    return full


def _read_optims(paths: list[Path], share: Optional[LoadShare], shapes_groups: Any, load: Loader, stage3: bool
                 ) -> list[dict[str, Any]]:
    """Every data-parallel rank's optimizer state; with ``share``, only the files holding its ranges are
    read (first one of those the layout predicts, its own when it is one: that file says the partition
    sizes), the others stand in as zeros."""
    if share is None:
        return [load(p)["optimizer_state_dict"] for p in paths]
    dp = len(paths)
    own = share.rank % dp if share.rank is not None else 0
    likely = (zero3_ranks(share, shapes_groups, dp) if stage3
              else zero12_ranks(share, shapes_groups, dp, estimated_sizes(shapes_groups, dp), None))
    mine = own if own in likely or not likely else min(likely)
    first = load(paths[mine])["optimizer_state_dict"]
    stage = int(first.get("zero_stage", 1))
    if stage == 3:
        needed = zero3_ranks(share, shapes_groups, dp)
    else:
        sizes = [t.numel() for t in first["single_partition_of_fp32_groups"]]
        needed = zero12_ranks(share, shapes_groups, dp, sizes, first.get("param_alignment_paddings"))
    blank: Optional[dict[str, Any]] = None
    out = []
    for r, path in enumerate(paths):
        if r == mine:
            out.append(first)
        elif r in needed:
            out.append(load(path)["optimizer_state_dict"])
        else:
            blank = blank if blank is not None else zeros_like_file(first, stage)
            out.append(blank)
    return out


def _required_optim(tag_dir: Path, dp_rank: int, mp_rank: int, dp: int) -> Path:
    path = _optim_path(tag_dir, dp_rank, mp_rank)
    if path is None:
        expected = detect.optim_state_file(tag_dir, dp_rank, mp_rank, bf16=False)
        raise CheckpointError(f"DeepSpeed checkpoint file {expected} does not exist: the checkpoint was written by "
                              f"{dp} data-parallel ranks and rank {dp_rank}'s optimizer file is missing; copy the "
                              "whole tag directory")
    return path


def _base_state(osd: dict[str, Any], stage: int) -> dict[str, Any]:
    return osd["optimizer_state_dict"] if stage == 3 else osd["base_optimizer_state"]


def _ep_group_values(osds: list[dict[str, Any]], g: int, shapes: Any, stage: int, where: str, with_optimizer: bool,
                     layers: list[moe.MoeLayer], ep_size: int | None
                     ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], dict[str, tuple]]:
    """``_group_values`` plus each tensor's shape, by name; an ``ep_size_<P>`` group of an MoE checkpoint is
    partitioned over each expert-parallel rank's expert-data-parallel ranks (``e, e + P, ...``) and its names
    are that rank's local experts: read per expert-parallel rank, renamed to global expert ids."""
    local = {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
    if ep_size is None:
        values, states = _group_values(osds, g, shapes, stage, where, with_optimizer)
        return values, states, local
    if len(osds) % ep_size:
        raise CheckpointError(f"{where}: an ep_size_{ep_size} group in a checkpoint of {len(osds)} data-parallel "
                              "ranks; the data-parallel size must be a multiple of ep_size")
    values, states, named = {}, {}, {}
    for e in range(ep_size):
        part_values, part_states = _group_values(osds[e::ep_size], g, shapes, stage, where, with_optimizer)
        rename = {n: moe.global_name(n, layers, e, ep_size) for n in shapes}
        values.update({rename[n]: v for n, v in part_values.items()})
        states.update({rename[n]: s for n, s in part_states.items()})
        named.update({rename[n]: local[n] for n in shapes})
    return values, states, named


def _group_values(osds: list[dict[str, Any]], g: int, shapes: Any, stage: int, where: str,
                  with_optimizer: bool) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Whole fp32 values (and Adam state) by name for group ``g``."""
    if stage == 3:
        split = lambda rank_flats: split_zero3(rank_flats, shapes, where)  # noqa: E731
        values = split([o["fp32_flat_groups"][g].float() for o in osds])
    else:
        pads = osds[0].get("param_alignment_paddings")
        split = lambda rank_flats: split_zero12(rank_flats, shapes, pads[g] if pads else None, where)  # noqa: E731
        values = split([o["single_partition_of_fp32_groups"][g].float() for o in osds])
    states: dict[str, dict[str, torch.Tensor]] = {name: {} for name in values}
    if not with_optimizer:
        return values, {}
    per_rank = [_base_state(o, stage)["state"].get(g, {}) for o in osds]
    for key, first in per_rank[0].items():
        if not torch.is_tensor(first):
            continue
        if first.dim() == 0:
            for name in values:
                states[name][key] = first.clone()
            continue
        for name, flat in split([s[key] for s in per_rank]).items():
            states[name][key] = flat
    return values, states


def _group_hparams(group: dict[str, Any]) -> dict[str, Any]:
    """deepshard's saved-group form: hyperparameters, ``__tuples__``, ``params`` (names, filled in later)."""
    out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
    out["__tuples__"] = [k for k, v in group.items() if isinstance(v, tuple) and k != "params"]
    out["params"] = []
    return out


def _module_extra(tag_dir: Path, first: dict[str, Any], model_files: list[Path], stage: int,
                  pipeline: bool, load: Loader) -> dict[str, torch.Tensor]:
    """Buffers and frozen parameters: from the state dict (ZeRO 0-2, pipeline layer files) or, for
    ZeRO-3's frozen parameters, joined from every rank's ``frozen_param_fragments``."""
    trainable = {n for shapes in first.get("param_shapes") or [] for n in shapes}
    module = _module_state(tag_dir, first, load) if pipeline else first.get("module") or {}
    out = {k: v for k, v in module.items() if k not in trainable and torch.is_tensor(v)}
    frozen_shapes = first.get("frozen_param_shapes") or {}
    if stage == 3 and frozen_shapes:
        frags = [load(p).get("frozen_param_fragments") or {} for p in model_files]
        for name, shape in frozen_shapes.items():
            flat = torch.cat([f[name].reshape(-1) for f in frags])[:numel_of(shape)]
            out[name] = flat.view(tuple(int(d) for d in shape)).clone()
    return out


def _module_state(tag_dir: Path, first: dict[str, Any], load: Loader = load_pt) -> dict[str, torch.Tensor]:
    """A pipeline's state dict from its ``layer_XX-model_states.pt`` files (keys ``<layer>.<name>``)."""
    out: dict[str, torch.Tensor] = {}
    for index, path in sorted(detect.layer_files(tag_dir).items()):
        for key, value in load(path).items():
            out[f"{index}.{key}"] = value
    return out


def _read_stage0(tag_dir: Path, first: dict[str, Any], path: Path, pipeline: bool, layers: list[moe.MoeLayer],
                 mp_rank: int) -> FullState:
    """No ZeRO: the model-states file holds the module and, in ``optimizer``, torch's optimizer state
    dict with parameters numbered in the module's parameter order (an MoE model: the experts and the
    optimizer state in their own files, ``deepspeed_format/experts.py``)."""
    module = _module_state(tag_dir, first) if pipeline else first.get("module") or {}
    buffers = set(first.get("buffer_names") or [])
    names = [k for k in module if k not in buffers]
    if layers:
        module = {**module, **moe.expert_weights(tag_dir, layers, mp_rank)}
    full = FullState({}, {}, {}, None, {}, dict(first.get("shared_params") or {}), {},
                     {"zero_stage": 0, "dp_world_size": int(first.get("dp_world_size", 1) or 1)})
    for name in names:
        full.params[name] = module[name].float().clone()
        full.shapes[name] = tuple(module[name].shape)
    for name in [k for k in module if k not in buffers and k not in full.params]:  # the experts
        full.params[name] = module[name].float().clone()
        full.shapes[name] = tuple(module[name].shape)
    full.module_extra = {k: module[k] for k in buffers if k in module}
    osd = first.get("optimizer")
    if layers:
        moe.read_stage0_optimizer(tag_dir, layers, names, full, mp_rank)
    elif isinstance(osd, dict) and "state" in osd and "param_groups" in osd:
        _stage0_optimizer(osd, names, full, path)
    return full


def _stage0_optimizer(osd: dict[str, Any], names: list[str], full: FullState, path: Path) -> None:
    """torch's ``optimizer.state_dict()`` keyed by parameter number; DeepSpeed without ZeRO keeps no fp32
    master copy besides the module (fp32) or the optimizer's own ``fp32_groups_flat`` (not read here)."""
    order = [i for g in osd["param_groups"] for i in g["params"]]
    if len(order) > len(names):
        raise CheckpointError(f"{path}: the optimizer holds {len(order)} parameters but the module {len(names)}")
    by_index = dict(zip(order, names))
    full.param_groups = []
    for group in osd["param_groups"]:
        g = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        g["__tuples__"] = [k for k, v in group.items() if isinstance(v, tuple)]
        g["params"] = [by_index[i] for i in group["params"]]
        full.param_groups.append(g)
    for index, state in osd["state"].items():
        name = by_index[int(index)]
        full.optim[name] = {k: (v.reshape(-1).clone() if torch.is_tensor(v) and v.dim() > 0 else v)
                            for k, v in state.items()}
        full.optim_kinds[name] = {k: ("elementwise" if torch.is_tensor(v) and v.dim() > 0 else "scalar")
                                  for k, v in state.items()}


__all__ = ["EngineRecord", "read_engine_record", "read_full_state", "loss_scaler_state"]
