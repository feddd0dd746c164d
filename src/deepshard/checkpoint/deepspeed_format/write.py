"""A deepshard checkpoint written as a DeepSpeed 0.19.8 directory, for a chosen data-parallel size and
ZeRO stage (what ``deepshard convert --to deepspeed`` does).

DeepSpeed resumes a ZeRO checkpoint only on the data-parallel size that wrote it, so the target layout
is the one the DeepSpeed job will run with. Parameters go into DeepSpeed's flat partitions in the
model's parameter order (the order of the rank files' ``shapes``: ``named_parameters()`` order, which is
DeepSpeed's optimizer order when the optimizer was built from ``model.parameters()``).
"""
from __future__ import annotations

import math
import re
import shutil
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from deepshard.checkpoint import io as ckpt_io
from deepshard.checkpoint.deepspeed_format.allowlist import (DynamicLossScalerRecord, FragmentAddressRecord,
                                                             LossScalerRecord, ZeroStage)
from deepshard.checkpoint.deepspeed_format.flat import join_zero3, join_zero12, numel_of
from deepshard.checkpoint.deepspeed_format.megatron_meta import checkpoint_parallel_metadata
from deepshard.checkpoint.deepspeed_format import write_experts as moe
from deepshard.checkpoint.deepspeed_format.pickle_names import save_pt
from deepshard.checkpoint.deepspeed_format.write_experts import FlatView
from deepshard.checkpoint.reader import load_full_state
from deepshard.checkpoint.state import unflatten_state
from deepshard.shard_state import FullState

DS_VERSION = "0.19.8"
ZERO12_ALIGN = 2  # DeepSpeed pads a ZeRO 1-2 group to a multiple of 2 x dp elements
Progress = Callable[[Iterable[Any], str], Iterable[Any]]


@dataclass
class Source:
    """A deepshard checkpoint, read whole."""

    full: FullState
    engine: dict[str, Any]
    scheduler: dict[str, Any] | None
    client_state: dict[str, Any]
    order: list[str]

    @property
    def dtype(self) -> torch.dtype:
        name = str(self.engine.get("param_dtype", "torch.float32")).replace("torch.", "")
        return getattr(torch, name, torch.float32)


def read_source(tag_dir: Path) -> Source:
    full = load_full_state(tag_dir, with_optimizer=True)
    engine = ckpt_io.load_json(tag_dir / "engine.json")
    state = unflatten_state(ckpt_io.load_tensors(tag_dir / "engine.safetensors"), engine["state"])
    order: list[str] = []
    for path in sorted(tag_dir.glob("zero_rank*.json"), key=lambda p: int(p.stem[len("zero_rank"):])):
        info = ckpt_io.load_json(path)
        # ``order``: the model's parameter order (JSON objects come back with sorted keys); files written
        # before it was recorded fall back to the names in natural order ("2.weight" before "10.weight")
        order += [n for n in info.get("order") or sorted(info["shapes"], key=_natural) if n not in order]
    return Source(full, engine, state.get("scheduler"), dict(state.get("client_state") or {}), order)


def _natural(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def write_deepspeed(src: Source, save_dir: Path, tag: str, dp: int, stage: int, progress: Progress,
                    ep: int = 1) -> Path:
    """Write ``save_dir/tag`` (staged, then renamed) and ``save_dir/latest``; returns the tag directory. A
    mixture-of-experts model is written for a DeepSpeed job whose MoE layers have ``ep_size`` ``ep``."""
    if stage not in (1, 2, 3):
        raise ValueError(f"--stage {stage}: DeepSpeed checkpoints are written for ZeRO stages 1, 2 or 3 "
                         "(a stage-0 DeepSpeed job can load the weights with load_module_only)")
    if dp < 1:
        raise ValueError(f"--dp {dp}: the data-parallel size is at least 1")
    grid = src.engine.get("grid", {})
    if int(grid.get("pp", 1)) > 1 or int(grid.get("tp", 1)) > 1:
        raise ValueError(f"the checkpoint was written on a grid {grid}: converting pipeline or tensor-parallel "
                         "checkpoints to DeepSpeed is not supported; save it from a data-parallel run first")
    layers = moe.find_layers(src.order or list(src.full.params))
    if layers:
        moe.check_target(layers, ep, dp, stage)
    ckpt_io.validate_tag(tag)
    staging = save_dir / f".tmp-{tag}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    groups = _groups(src, layers, ep)
    for rank in progress(range(dp), "optimizer files"):
        _write_optim(src, groups, staging, rank, dp, stage, _views(src, groups, layers, stage, dp, ep, rank))
    _write_models(src, groups, staging, dp, stage, _views(src, groups, layers, stage, dp, ep, 0))
    if layers:
        moe.write_expert_files(src.full.params, layers, src.dtype, staging)
    final = save_dir / tag
    if final.exists():
        shutil.rmtree(final)
    staging.replace(final)
    (save_dir / "latest").write_text(tag)
    return final


def _groups(src: Source, layers: list[moe.MoeLayer], ep: int) -> list[tuple[dict[str, Any], list[str]]]:
    """(hyperparameters, names in model order) per optimizer parameter group."""
    rank = {name: i for i, name in enumerate(src.order)}
    saved = src.full.param_groups or [{"params": list(src.full.params), "__tuples__": []}]
    if len(saved) == 1:  # one group holds every trainable parameter (rank files may list only their own)
        saved = [{**saved[0], "params": list(src.full.params)}]
    if layers:
        saved = _moe_groups(saved, [n for n in src.full.params if moe.is_expert(n, layers)], ep)
    listed = {n for group in saved for n in group["params"]}
    unlisted = sorted(set(src.full.params) - listed)
    if unlisted:
        raise ValueError(f"the checkpoint's optimizer groups do not say which group holds {unlisted[:5]}; "
                         "convert a checkpoint saved with a single parameter group, or save it with ZeRO stage 0")
    out = []
    for group in saved:
        tuples = set(group.get("__tuples__", []))
        hp = {k: (tuple(v) if k in tuples else v) for k, v in group.items() if k not in ("params", "__tuples__")}
        names = sorted((n for n in group["params"] if n in src.full.params), key=lambda n: rank.get(n, len(rank)))
        out.append((hp, names))
    return out


def _moe_groups(saved: list[dict[str, Any]], experts: list[str], ep: int) -> list[dict[str, Any]]:
    """DeepSpeed's MoE optimizer groups: the dense groups without experts, then one ``ep_size_<ep>`` group marked
    ``moe`` holding every expert (the saved one's hyperparameters, or the first group's)."""
    expert_set = set(experts)
    marked = [g for g in saved if g.get("moe")]
    dense = [{**g, "params": [n for n in g["params"] if n not in expert_set]} for g in saved if not g.get("moe")]
    base = marked[0] if marked else saved[0]
    return [g for g in dense if g["params"]] + [{**base, "name": f"ep_size_{ep}", "moe": True, "params": experts}]


def _views(src: Source, groups: list[tuple[dict[str, Any], list[str]]], layers: list[moe.MoeLayer], stage: int,
           dp: int, ep: int, rank: int) -> list[FlatView]:
    """Each flat vector as ``rank``'s files name and share it."""
    out = []
    for g, names in _flat_groups(src, groups, stage, dp):
        if layers and groups[g][0].get("moe"):
            out.append(moe.expert_view(names, layers, ep, dp, rank))
        else:
            out.append(FlatView(names, names, dp, rank))
    return out


def _shapes(src: Source, names: list[str], view: FlatView | None = None) -> "OrderedDict[str, torch.Size]":
    if view is not None:
        return OrderedDict((n, torch.Size(src.full.shapes[s])) for n, s in zip(view.names, view.source))
    return OrderedDict((n, torch.Size(src.full.shapes[n])) for n in names)


def _zero3_subgroups(src: Source, names: list[str], dp: int, sub_group_size: int = 10 ** 9) -> list[list[str]]:
    """DeepSpeed's ZeRO-3 sub-groups: parameters taken in order until their per-rank pieces reach
    ``sub_group_size`` elements (the default of ``zero_optimization.sub_group_size``)."""
    pieces = [math.ceil(numel_of(src.full.shapes[n]) / dp) for n in names]
    if sum(pieces) <= sub_group_size:
        return [names]
    out, current, size = [], [], 0
    for name, piece in zip(names, pieces):
        current.append(name)
        size += piece
        if size >= sub_group_size or name == names[-1]:
            out.append(current)
            current, size = [], 0
    return out


def _flat_groups(src: Source, groups: list[tuple[dict[str, Any], list[str]]], stage: int, dp: int
                 ) -> list[tuple[int, list[str]]]:
    """(owning group, names) per flat vector: one per group at ZeRO 1-2, per sub-group at ZeRO-3."""
    if stage < 3:
        return [(g, names) for g, (_, names) in enumerate(groups)]
    return [(g, sub) for g, (_, names) in enumerate(groups) for sub in _zero3_subgroups(src, names, dp)]


def _partitions(src: Source, values: dict[str, torch.Tensor], view: FlatView, stage: int
                ) -> tuple[list[torch.Tensor], int]:
    """The vector's partitions over ``view.parts`` ranks (``values`` by the checkpoint's names)."""
    shapes = _shapes(src, view.names, view)
    named = {n: values[s] for n, s in zip(view.names, view.source)}
    if stage == 3:
        return join_zero3(named, shapes, view.parts), 0
    return join_zero12(named, shapes, view.parts, ZERO12_ALIGN)


def _write_optim(src: Source, groups: list[tuple[dict[str, Any], list[str]]], staging: Path, rank: int, dp: int,
                 stage: int, views: list[FlatView]) -> None:
    flats = _flat_groups(src, groups, stage, dp)
    fp32, state, paddings, mappings = [], {}, [], []
    for index, view in enumerate(views):
        parts, padding = _partitions(src, src.full.params, view, stage)
        fp32.append(parts[view.part])
        paddings.append(padding if view.part == view.parts - 1 else 0)
        state[index] = _flat_state(src, view, stage)
        mappings.append(_slice_mappings(src, view, parts[view.part].numel()))
    param_groups = [{**hp, "params": [i for i, (owner, _) in enumerate(flats) if owner == g]}
                    for g, (hp, _) in enumerate(groups)]
    base = {"state": {i: s for i, s in state.items() if s}, "param_groups": param_groups}
    common = {"loss_scaler": _loss_scaler(src.engine.get("loss_scaler", {})),
              "dynamic_loss_scale": src.engine.get("loss_scaler", {}).get("kind") == "dynamic", "overflow": False,
              "zero_stage": ZeroStage(stage)}
    if stage == 3:
        osd = {**common, "partition_count": dp, "optimizer_state_dict": base, "fp32_flat_groups": fp32}
    else:
        osd = {**common, "base_optimizer_state": base, "single_partition_of_fp32_groups": fp32,
               "group_paddings": paddings, "param_alignment_paddings": [[0] * len(v.names) for v in views],
               "partition_count": [v.parts for v in views], "ds_version": DS_VERSION, "param_slice_mappings": mappings}
    save_pt({"optimizer_state_dict": osd, "ds_config": _ds_config(src, stage), "ds_version": DS_VERSION},
            staging / f"{'bf16_' if src.dtype == torch.bfloat16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")


def _flat_state(src: Source, view: FlatView, stage: int) -> dict[str, torch.Tensor]:
    """One flat vector's optimizer state on this rank: elementwise states partitioned like the values,
    scalars (Adam's ``step``) as they are."""
    names = view.source
    first = src.full.optim.get(names[0], {}) if names else {}
    out: dict[str, torch.Tensor] = {}
    for key, value in first.items():
        kind = src.full.optim_kinds.get(names[0], {}).get(key)
        if kind == "elementwise":
            per_name = {n: src.full.optim[n][key].reshape(-1) for n in names}
            out[key] = _partitions(src, per_name, view, stage)[0][view.part]
        elif torch.is_tensor(value):
            out[key] = value.clone().float()
        elif isinstance(value, (int, float)):
            out[key] = torch.tensor(float(value))
    return out


def _slice_mappings(src: Source, view: FlatView, size: int) -> "OrderedDict[str, Any]":
    """ZeRO 1-2's ``param_slice_mappings``: where each parameter's slice sits in this rank's partition."""
    out: "OrderedDict[str, Any]" = OrderedDict()
    lo, offset = view.part * size, 0
    for name, source in zip(view.names, view.source):
        n = numel_of(src.full.shapes[source])
        start, end = max(offset, lo), min(offset + n, lo + size)
        if start < end:
            out[name] = FragmentAddressRecord(numel=end - start, start=start - lo)
        offset += n
    return out


def _loss_scaler(state: dict[str, Any]) -> Any:
    if state.get("kind") == "dynamic":
        hysteresis = int(state.get("hysteresis_left", 2))
        return DynamicLossScalerRecord(
            cur_scale=float(state["scale"]), cur_iter=int(state.get("iteration", 0)),
            last_overflow_iter=int(state.get("last_overflow_iteration", -1)), scale_factor=2.0, scale_window=1000,
            min_scale=1.0, delayed_shift=hysteresis, cur_hysteresis=hysteresis, consecutive_hysteresis=False,
            raise_error_at_min_scale=True, dynamic=True, dtype=torch.float16)
    return LossScalerRecord(cur_scale=float(state.get("scale", 1.0)), dynamic=False)


def _ds_config(src: Source, stage: int) -> dict[str, Any]:
    return {"zero_optimization": {"stage": stage}, "bf16": {"enabled": src.dtype == torch.bfloat16},
            "fp16": {"enabled": src.dtype == torch.float16}}


def _write_models(src: Source, groups: list[tuple[dict[str, Any], list[str]]], staging: Path, dp: int,
                  stage: int, views: list[FlatView]) -> None:
    """The model states (rank 0's ``param_shapes``: its local experts' names; the experts' own files are
    ``write_experts``')."""
    trainable = [n for (hp, names) in groups if not hp.get("moe") for n in names]
    frozen = [n for n in src.full.meta.get("frozen_params", []) if n in src.full.module_extra]
    buffers = [k for k in src.full.module_extra if k not in frozen]
    common = {
        "buffer_names": buffers, "optimizer": None,
        "param_shapes": [_shapes(src, view.names, view) for view in views],
        "shared_params": dict(src.full.aliases), "lr_scheduler": src.scheduler, "data_sampler": None,
        "random_ltd": None, "skipped_steps": int(src.engine.get("skipped_steps", 0)),
        "global_steps": int(src.engine.get("global_steps", 0)),
        "global_samples": int(src.engine.get("global_samples", 0)), "dp_world_size": dp, "mp_world_size": 1,
        **checkpoint_parallel_metadata(None), "ds_config": _ds_config(src, stage),  # written for pp=1, tp=1
        "ds_version": DS_VERSION}
    frozen_shapes = OrderedDict((n, torch.Size(src.full.module_extra[n].shape)) for n in frozen)
    if stage < 3:
        module = OrderedDict((n, src.full.params[n].to(src.dtype)) for n in trainable)
        module.update((k, v) for k, v in src.full.module_extra.items())
        module.update((alias, module[name]) for alias, name in src.full.aliases.items() if name in module)
        state = {"module": module, **common,
                 "frozen_param_shapes": frozen_shapes if stage == 2 else None,
                 "frozen_param_fragments": OrderedDict((n, src.full.module_extra[n]) for n in frozen)
                 if stage == 2 else None}
        extras = moe.model_state_extras(moe.find_layers(src.order or list(src.full.params)))
        save_pt({**state, **(extras if extras["num_experts"] else {}), **src.client_state},
                staging / "mp_rank_00_model_states.pt")
        return
    for rank in range(dp):
        module = OrderedDict((n, torch.empty(0, dtype=src.dtype)) for n in trainable)
        module.update((k, src.full.module_extra[k]) for k in buffers)
        fragments = OrderedDict((n, _zero3_piece(src.full.module_extra[n], dp, rank)) for n in frozen)
        state = {"module": module, **common, "frozen_param_shapes": frozen_shapes,
                 "frozen_param_fragments": fragments}
        save_pt({**state, **src.client_state}, staging / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")


def _zero3_piece(value: torch.Tensor, dp: int, rank: int) -> torch.Tensor:
    flat = value.reshape(-1)
    piece = math.ceil(flat.numel() / dp)
    flat = torch.cat([flat, flat.new_zeros(piece * dp - flat.numel())])
    return flat[rank * piece:(rank + 1) * piece].clone()
