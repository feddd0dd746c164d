"""Saving an engine: orchestrates ranks, staging, the manifest and the ``latest`` file (loading:
``engine_load.py``; both know an engine by the :class:`CheckpointedEngine` protocol).

Layout of ``save_dir/<tag>/``: each rank's share of the strategy's states as fragment files
(``zero_rank<r>.safetensors`` + ``.json``, ``fragments.py``; the strategy hands them over as plain data,
``deepshard.shard_state``), ``engine.json`` + ``engine.safetensors`` (counters, loss scaler, LR scheduler,
client_state), ``rng_rank<r>.safetensors`` per rank, and ``manifest.json`` (size and sha256 of every
file). Everything is written into ``save_dir/.tmp-<tag>`` first and renamed into place by rank 0
after all ranks finished, so a crash mid-save leaves the previous checkpoint whole. Loading never
unpickles.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Protocol

import torch

from deepshard.checkpoint import io as ckpt_io
from deepshard.checkpoint.collective import CheckpointSaveError, agree_on_tag, run_phase
from deepshard.checkpoint.fragments import save_rank_fragments
from deepshard.checkpoint.layout import module_splits
from deepshard.checkpoint.module_state import frozen_param_names, module_shapes, param_aliases
from deepshard.checkpoint.reader import ENGINE_JSON, ENGINE_TENSORS, rng_file
from deepshard.checkpoint.rng_streams import stream_states
from deepshard.checkpoint.state import flatten_state
from deepshard.comm.group import CommGroup
from deepshard.precision import LossScaler, PrecisionPolicy
from deepshard.step import TrainState
from deepshard.topology import Topology
from deepshard.utils.logging import logger
from deepshard.zero.strategy import ZeroStrategy

FORMAT_VERSION = 2  # 2: the grid is recorded and fragments may be tensor-parallel parts (layout.py)
__all__ = ["ENGINE_JSON", "ENGINE_TENSORS", "FORMAT_VERSION", "CheckpointedEngine", "save_engine_checkpoint",
           "save_16bit_model", "consolidated_16bit_state_dict"]


class CheckpointedEngine(Protocol):
    """What saving and loading read of an engine (both engines are one): ``checkpoint/`` knows engines by
    this shape only, so it never imports them."""

    module: torch.nn.Module
    topology: Topology
    comm: CommGroup
    strategy: ZeroStrategy
    state: TrainState
    lr_scheduler: Any
    loss_scaler: LossScaler
    precision: PrecisionPolicy
    dp_world_size: int

    def gradient_accumulation_steps(self) -> int: ...

    def zero_optimization_stage(self) -> int: ...

    def zero_gather_16bit_weights_on_model_save(self) -> bool: ...

    def checkpoint_tag_validation_mode(self) -> str: ...

    def _get_optimizer_ckpt_name(self, checkpoints_path: Any, tag: Any, expp_rank: int = 0) -> str: ...

    def _change_recovery_script_permissions(self, dst: Any) -> None: ...


def save_engine_checkpoint(engine: "CheckpointedEngine", save_dir: Path, tag: str | None,
                           client_state: dict[str, Any], save_latest: bool,
                           exclude_frozen_parameters: bool) -> bool:
    """Save in three failure-collective phases (``checkpoint/collective.py``): rank 0 prepares the staging
    directory, every rank writes its files, rank 0 publishes. If any rank fails a phase, every rank raises
    the same :class:`CheckpointSaveError` and rank 0 removes the staging directory. Ranks passing
    different tags are handled by the ``checkpoint.tag_validation`` mode (``collective.agree_on_tag``)."""
    tag = ckpt_io.validate_tag(str(tag) if tag is not None else f"global_step{engine.state.global_steps}")
    # every rank of the grid writes its files (named by global rank); global rank 0 publishes
    comm, rank = engine.topology.world, engine.topology.rank
    tag = agree_on_tag(comm, tag, engine.checkpoint_tag_validation_mode())
    staging = ckpt_io.staging_path(save_dir, tag)
    run_phase(comm, f"creating {staging}", lambda: _prepare_staging(save_dir, tag) if rank == 0 else None)
    try:
        files = run_phase(comm, f"writing the checkpoint files into {staging}",
                          lambda: _write_rank_files(engine, staging, client_state, tag, exclude_frozen_parameters))
        records = _gather_records(engine, files or {})
        run_phase(comm, f"publishing {save_dir / tag}",
                  lambda: _publish(engine, staging, save_dir, tag, records, save_latest) if rank == 0 else None)
    except CheckpointSaveError:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return True


def _prepare_staging(save_dir: Path, tag: str) -> None:
    """Rank 0, before anyone writes: clean what interrupted saves left behind, create an empty staging dir."""
    save_dir.mkdir(parents=True, exist_ok=True)
    for change in ckpt_io.repair_save_dir(save_dir, keep=tag):
        logger.info("%s: %s", save_dir, change)
    ckpt_io.staging_dir(save_dir, tag)


def _write_rank_files(engine: "CheckpointedEngine", staging: Path, client_state: dict[str, Any], tag: str,
                      exclude_frozen_parameters: bool) -> dict[str, dict[str, Any]]:
    """This rank's files, each with its manifest record (size and sha256, taken by the rank that wrote it:
    publishing then never reads the checkpoint back on one rank)."""
    rank = engine.topology.rank
    files = _write_shard(engine, staging, exclude_frozen_parameters)
    ckpt_io.save_tensors(staging / rng_file(rank), stream_states(engine.module))
    files.append(rng_file(rank))
    if rank == 0:
        files += _save_engine_state(engine, staging, client_state, tag)
    return {name: ckpt_io.file_entry(staging / name) for name in files}


def _write_shard(engine: "CheckpointedEngine", staging: Path, exclude_frozen: bool) -> list[str]:
    """The strategy's share of this rank (``ShardState``: plain data) as fragment files, with the module's
    names, shapes, aliases and tensor-parallel splits; every rank asks (a collective at stage 3)."""
    module = engine.module
    shard = engine.strategy.shard_state(exclude_frozen)
    if shard is None:
        return []
    meta = {**shard.meta, "frozen_params": frozen_param_names(module)}
    # the file holding this rank's optimizer state is the one the engine names (staged under .tmp-<tag>)
    tensor_file = Path(engine._get_optimizer_ckpt_name(staging.parent, staging.name)).name
    return save_rank_fragments(staging, engine.topology.rank, shard.records, module_shapes(module), shard.param_groups,
                               param_aliases(module), shard.module_extra, meta, splits=module_splits(module),
                               tensor_file=tensor_file)


def _publish(engine: "CheckpointedEngine", staging: Path, save_dir: Path, tag: str,
             records: dict[str, dict[str, Any]], save_latest: bool) -> None:
    ckpt_io.write_manifest(staging, sorted(records), known=records)
    ckpt_io.commit_staging(staging, save_dir / tag)
    if save_latest:
        ckpt_io.write_latest(save_dir, tag)
    engine._change_recovery_script_permissions(_write_zero_to_fp32_script(save_dir))
    logger.info("saved checkpoint %s", save_dir / tag)


_ZERO_TO_FP32_SCRIPT = '''#!/usr/bin/env python
"""Consolidate this directory's ZeRO checkpoint into one fp32 state dict (written by deepshard).

    python zero_to_fp32.py . OUTPUT_DIR [--safe_serialization] [-t TAG]
"""
import sys

from deepshard.utils.zero_to_fp32 import main

if __name__ == "__main__":
    sys.exit(main())
'''


def _write_zero_to_fp32_script(save_dir: Path) -> Path:
    """DeepSpeed leaves a ``zero_to_fp32.py`` beside its checkpoints; so do we (a two-line launcher, made
    executable by the engine's ``_change_recovery_script_permissions``). Returns its path."""
    target = save_dir / "zero_to_fp32.py"
    if not target.exists():
        tmp = target.with_name(".zero_to_fp32.py.tmp")
        tmp.write_text(_ZERO_TO_FP32_SCRIPT)
        tmp.replace(target)
    return target


def _gather_records(engine: "CheckpointedEngine", records: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every rank's file records on global rank 0, which writes the manifest ({} on the other ranks: a
    gather, not an all-gather, so no rank but the publisher receives the O(world size) list)."""
    import torch.distributed as dist

    world = engine.topology.world
    if world.size == 1:
        return records
    gathered: list[Any] | None = [None] * world.size if world.rank == 0 else None
    dist.gather_object(records, gathered, dst=world.peers[0], group=world.group)
    return {name: rec for part in (gathered or []) for name, rec in part.items()}


def _save_engine_state(engine: "CheckpointedEngine", directory: Path, client_state: dict[str, Any],
                       tag: str) -> list[str]:
    state = {
        "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "client_state": client_state,
    }
    tensors, skeleton = flatten_state(state)
    meta = {
        "format": "deepshard-engine", "version": FORMAT_VERSION, "tag": tag,
        "global_steps": engine.state.global_steps, "global_samples": engine.state.global_samples,
        "micro_steps": engine.state.micro_steps, "skipped_steps": engine.state.skipped_steps,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "zero_stage": engine.zero_optimization_stage(), "dp_world_size": engine.dp_world_size,
        "grid": {"pp": engine.topology.dims.pp, "dp": engine.topology.dims.dp, "tp": engine.topology.dims.tp,
                 "sp": engine.topology.dims.sp},
        "param_dtype": str(engine.precision.param_dtype),
        "state": skeleton,
    }
    ckpt_io.save_tensors(directory / ENGINE_TENSORS, tensors)
    ckpt_io.save_json(directory / ENGINE_JSON, meta)
    return [ENGINE_TENSORS, ENGINE_JSON]


def consolidated_16bit_state_dict(engine: "CheckpointedEngine", exclude_frozen_parameters: bool = False
                                  ) -> dict[str, torch.Tensor]:
    """The full module state dict in its compute dtype on rank 0 ({} on other ranks when the strategy
    partitions parameters, where building it is a collective every rank must join)."""
    return engine.strategy.consolidated_state_dict(engine.comm.rank, exclude_frozen_parameters)


def save_16bit_model(engine: "CheckpointedEngine", save_dir: Path, filename: str,
                     exclude_frozen_parameters: bool) -> bool:
    if engine.strategy.capabilities.partitioned_parameters and not engine.zero_gather_16bit_weights_on_model_save():
        logger.warning("save_16bit_model under ZeRO-3 needs \"stage3_gather_16bit_weights_on_model_save\": true "
                       "in zero_optimization (gathering the full model costs memory); nothing was saved. "
                       "Alternatively consolidate a checkpoint with deepshard.utils.zero_to_fp32")
        return False
    from deepshard.tp.consolidate import gather_tensor_parallel

    from deepshard.checkpoint.experts import whole_state_dict

    state = consolidated_16bit_state_dict(engine, exclude_frozen_parameters)
    state = whole_state_dict(state, engine.module, engine.topology.world)  # every expert, by global id
    state = gather_tensor_parallel(state, engine.module, engine.topology.tp)  # whole tensors, not tp slices
    writer = engine.comm.rank == 0 and engine.topology.coord.tp == 0  # one per pipeline stage
    if writer and engine.topology.dims.pp > 1:
        state = _gather_stages(state, engine.topology.pp)  # every stage's layers in one file
    if writer and engine.topology.coord.pp == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        target = save_dir / filename
        if filename.endswith(".safetensors"):
            ckpt_io.save_tensors(target, state, record_name=False)  # for other tools: no checkpoint stamp
        else:
            tmp = target.with_name(target.name + ".tmp")
            torch.save({k: v.clone() for k, v in state.items()}, tmp)
            tmp.replace(target)
        logger.info("saved 16-bit model weights to %s", target)
    engine.comm.barrier()
    return True


def _gather_stages(state: dict[str, torch.Tensor], pp: Any) -> dict[str, torch.Tensor]:
    """Every pipeline stage's state dict joined on the first stage (collective over this replica's
    pipeline group; {} elsewhere). Stage-local names are the whole model's (layer indices are global),
    and a tied layer's copies are equal, so the union is the single-process model's state dict."""
    import torch.distributed as dist

    parts: list[Any] = [None] * pp.size if pp.rank == 0 else []
    dist.gather_object(state, parts if pp.rank == 0 else None, dst=pp.peers[0], group=pp.group)
    if pp.rank != 0:
        return {}
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, value in part.items():
            merged.setdefault(name, value)
    return {name: merged[name] for name in sorted(merged, key=_layer_order)}


def _layer_order(name: str) -> tuple[int, str]:
    head = name.split(".", 1)[0]
    return (int(head), name) if head.isdigit() else (-1, name)
