"""Saving and loading an engine: orchestrates ranks, staging, the manifest and the ``latest`` file.

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
from typing import Any, Optional, Protocol

import torch

from deepshard.checkpoint import io as ckpt_io
from deepshard.checkpoint.collective import CheckpointSaveError, run_phase
from deepshard.checkpoint.deepspeed_format.detect import deepspeed_tag_dir
from deepshard.checkpoint.fragments import save_rank_fragments
from deepshard.checkpoint.layout import module_splits
from deepshard.checkpoint.module_state import check_model_names, frozen_param_names, module_shapes, param_aliases
from deepshard.checkpoint.reader import (ENGINE_JSON, ENGINE_TENSORS, DeepShardTag, DeepSpeedTag, Resume, TagReader,
                                         rng_file)
from deepshard.checkpoint.rng_streams import restore_streams, stream_states
from deepshard.checkpoint.state import flatten_state
from deepshard.comm.group import CommGroup
from deepshard.precision import LossScaler, PrecisionPolicy
from deepshard.step import TrainState
from deepshard.topology import Topology
from deepshard.utils.logging import logger
from deepshard.zero.strategy import ZeroStrategy

FORMAT_VERSION = 2  # 2: the grid is recorded and fragments may be tensor-parallel parts (layout.py)
__all__ = ["ENGINE_JSON", "ENGINE_TENSORS", "FORMAT_VERSION", "CheckpointedEngine", "load_engine_checkpoint",
           "save_engine_checkpoint", "save_16bit_model", "consolidated_16bit_state_dict"]


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


def save_engine_checkpoint(engine: "CheckpointedEngine", save_dir: Path, tag: str | None,
                           client_state: dict[str, Any], save_latest: bool,
                           exclude_frozen_parameters: bool) -> bool:
    """Save in three failure-collective phases (``checkpoint/collective.py``): rank 0 prepares the staging
    directory, every rank writes its files, rank 0 publishes. If any rank fails a phase, every rank raises
    the same :class:`CheckpointSaveError` and rank 0 removes the staging directory."""
    tag = ckpt_io.validate_tag(str(tag) if tag is not None else f"global_step{engine.state.global_steps}")
    # every rank of the grid writes its files (named by global rank); global rank 0 publishes
    comm, rank = engine.topology.world, engine.topology.rank
    staging = ckpt_io.staging_path(save_dir, tag)
    run_phase(comm, f"creating {staging}", lambda: _prepare_staging(save_dir, tag) if rank == 0 else None)
    try:
        files = run_phase(comm, f"writing the checkpoint files into {staging}",
                          lambda: _write_rank_files(engine, staging, client_state, tag, exclude_frozen_parameters))
        all_files = _gather_file_lists(engine, files or [])
        run_phase(comm, f"publishing {save_dir / tag}",
                  lambda: _publish(staging, save_dir, tag, all_files, save_latest) if rank == 0 else None)
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
                      exclude_frozen_parameters: bool) -> list[str]:
    rank = engine.topology.rank
    files = _write_shard(engine, staging, exclude_frozen_parameters)
    ckpt_io.save_tensors(staging / rng_file(rank), stream_states(engine.module))
    files.append(rng_file(rank))
    if rank == 0:
        files += _save_engine_state(engine, staging, client_state, tag)
    return files


def _write_shard(engine: "CheckpointedEngine", staging: Path, exclude_frozen: bool) -> list[str]:
    """The strategy's share of this rank (``ShardState``: plain data) as fragment files, with the module's
    names, shapes, aliases and tensor-parallel splits; every rank asks (a collective at stage 3)."""
    module = engine.module
    shard = engine.strategy.shard_state(exclude_frozen)
    if shard is None:
        return []
    meta = {**shard.meta, "frozen_params": frozen_param_names(module)}
    return save_rank_fragments(staging, engine.topology.rank, shard.records, module_shapes(module), shard.param_groups,
                               param_aliases(module), shard.module_extra, meta, splits=module_splits(module))


def _publish(staging: Path, save_dir: Path, tag: str, all_files: list[str], save_latest: bool) -> None:
    ckpt_io.write_manifest(staging, sorted(set(all_files)))
    ckpt_io.commit_staging(staging, save_dir / tag)
    if save_latest:
        ckpt_io.write_latest(save_dir, tag)
    _write_zero_to_fp32_script(save_dir)
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


def _write_zero_to_fp32_script(save_dir: Path) -> None:
    """DeepSpeed leaves a ``zero_to_fp32.py`` beside its checkpoints; so do we (a two-line launcher)."""
    target = save_dir / "zero_to_fp32.py"
    if not target.exists():
        tmp = target.with_name(".zero_to_fp32.py.tmp")
        tmp.write_text(_ZERO_TO_FP32_SCRIPT)
        tmp.replace(target)


def _gather_file_lists(engine: "CheckpointedEngine", files: list[str]) -> list[str]:
    import torch.distributed as dist

    world = engine.topology.world
    if world.size == 1:
        return files
    gathered: list[Any] = [None] * world.size
    dist.all_gather_object(gathered, files, group=world.group)
    return [f for part in gathered for f in part]


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


def load_engine_checkpoint(engine: "CheckpointedEngine", load_dir: Path, tag: str | None, strict: bool,
                           load_optimizer_states: bool, load_lr_scheduler_states: bool,
                           load_module_only: bool) -> tuple[str | None, dict | None]:
    """Load a tag of either format through its one reader (``checkpoint/reader.py``): its files checked and
    its engine record read, then the weights checked against the model's names and handed to the
    strategy, then the counters, the loss scaler, the LR scheduler and the RNG streams."""
    reader = _open_for_load(engine, load_dir, tag)
    if reader is None:
        return None, None
    resume = reader.resume(engine.topology.rank, engine.topology.dims)
    full = reader.full_state(engine.module, with_optimizer=load_optimizer_states and not load_module_only)
    check_model_names(engine.module, full, strict, reader.path)
    engine.strategy.load_state(full, load_optimizer_states and not load_module_only)
    if not load_module_only:
        _apply_resume(engine, resume, load_lr_scheduler_states)
        engine.topology.world.barrier()
    return str(reader.path), resume.client_state


def _open_for_load(engine: "CheckpointedEngine", load_dir: Path, tag: str | None) -> Optional[TagReader]:
    """The reader of the tag ``load_checkpoint(load_dir, tag)`` means (``load_dir/latest`` without a tag), or
    None (said in a warning) when there is nothing to load."""
    ds_tag = deepspeed_tag_dir(load_dir, tag)
    if ds_tag is not None:  # a directory DeepSpeed's save_checkpoint wrote: read as it is, no pickle run
        return DeepSpeedTag(ds_tag)
    if tag is None:
        tag = ckpt_io.read_latest(load_dir)
        if tag is None:
            logger.warning("no 'latest' file in %s: nothing loaded; pass tag=... to load a specific "
                           "checkpoint", load_dir)
            return None
    path = load_dir / str(tag)
    _recover_interrupted_publication(engine, load_dir, str(tag))
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist; tags in {load_dir}: "
                                f"{sorted(p.name for p in load_dir.iterdir() if p.is_dir() and not p.name.startswith('.'))}")
    return DeepShardTag(path)


def _apply_resume(engine: "CheckpointedEngine", resume: Resume, load_lr_scheduler_states: bool) -> None:
    state = engine.state
    state.global_steps = resume.global_steps
    state.global_samples = resume.global_samples
    # realign the micro-step counter with *this* run's accumulation steps (they may differ from the saver's)
    state.micro_steps = state.global_steps * engine.gradient_accumulation_steps()
    state.skipped_steps = resume.skipped_steps
    current = engine.loss_scaler.state_dict()
    if not resume.scaler_same_kind_only or current.get("kind") == resume.loss_scaler.get("kind"):
        engine.loss_scaler.load_state_dict(resume.loss_scaler)
    else:
        logger.info("the DeepSpeed checkpoint's loss scaler is %s, this run's %s: keeping this run's",
                    resume.loss_scaler.get("kind"), current.get("kind"))
    if load_lr_scheduler_states and engine.lr_scheduler is not None and resume.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(resume.lr_scheduler)
    if resume.rng_file is not None:
        restore_streams(engine.module, ckpt_io.load_tensors(resume.rng_file))  # deepshard's streams; not torch's


def _recover_interrupted_publication(engine: "CheckpointedEngine", load_dir: Path, tag: str) -> None:
    """A save of an existing tag that crashed between its two renames left the intact copy aside
    (``.old-<tag>-<n>``): rank 0 puts it back before anyone looks for ``<tag>``."""
    if engine.topology.rank == 0 and load_dir.is_dir():
        try:
            if not (load_dir / tag).exists() and ckpt_io.recover_tag(load_dir, tag):
                logger.warning("%s: restored checkpoint %s from the copy an interrupted save left aside",
                               load_dir, tag)
        except (OSError, ValueError) as err:
            logger.warning("%s: could not restore %s from its aside copy: %s", load_dir, tag, err)
    engine.topology.world.barrier(f"load_checkpoint({tag!r}): waiting for rank 0 to check {load_dir}")


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

    state = consolidated_16bit_state_dict(engine, exclude_frozen_parameters)
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
