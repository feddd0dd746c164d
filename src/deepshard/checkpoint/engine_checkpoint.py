"""Saving and loading an engine: orchestrates ranks, staging, the manifest and the ``latest`` file.

Layout of ``save_dir/<tag>/``: the strategy's files (``model.safetensors``, ``optimizer.safetensors`` +
``optimizer.json`` for stage 0), ``engine.json`` + ``engine.safetensors`` (counters, loss scaler, LR
scheduler, client_state), ``rng_rank<r>.safetensors`` per rank, and ``manifest.json`` (size and sha256 of
every file). Everything is written into ``save_dir/.tmp-<tag>`` first and renamed into place by rank 0
after all ranks finished, so a crash mid-save leaves the previous checkpoint whole. Loading never
unpickles.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepshard.checkpoint import io as ckpt_io
from deepshard.checkpoint import ledger, schema
from deepshard.checkpoint.collective import CheckpointSaveError, agree_on_load, run_phase
from deepshard.checkpoint.rng_streams import restore_streams, stream_states
from deepshard.checkpoint.state import flatten_state, unflatten_state
from deepshard.checkpoint.verify import ManifestVerifier
from deepshard.utils.logging import logger

if TYPE_CHECKING:
    from deepshard.engine import DeepShardEngine

ENGINE_JSON = "engine.json"
ENGINE_TENSORS = "engine.safetensors"
FORMAT_VERSION = 2  # 2: the grid is recorded and fragments may be tensor-parallel parts (layout.py)


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank}.safetensors"


def save_engine_checkpoint(engine: "DeepShardEngine", save_dir: Path, tag: str | None,
                           client_state: dict[str, Any], save_latest: bool,
                           exclude_frozen_parameters: bool) -> bool:
    """Save in three failure-collective phases (``checkpoint/collective.py``): rank 0 prepares the staging
    directory, every rank writes its files, rank 0 publishes. If any rank fails a phase, every rank raises
    the same :class:`CheckpointSaveError` and rank 0 removes the staging directory."""
    tag = ckpt_io.validate_tag(str(tag) if tag is not None else f"global_step{engine.global_steps}")
    # every rank of the grid writes its files (named by global rank); global rank 0 publishes
    comm, rank = engine.topology.world, engine.topology.rank
    staging = ckpt_io.staging_path(save_dir, tag)
    run_phase(comm, f"creating {staging}", lambda: _prepare_staging(save_dir, tag) if rank == 0 else None)
    try:
        files = run_phase(comm, f"writing the checkpoint files into {staging}",
                          lambda: _write_rank_files(engine, staging, client_state, tag, exclude_frozen_parameters))
        records = _gather_records(engine, files or {})
        run_phase(comm, f"publishing {save_dir / tag}",
                  lambda: _publish(staging, save_dir, tag, records, save_latest) if rank == 0 else None)
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


def _write_rank_files(engine: "DeepShardEngine", staging: Path, client_state: dict[str, Any], tag: str,
                      exclude_frozen_parameters: bool) -> dict[str, dict[str, Any]]:
    """This rank's files, each with its manifest record (size and sha256, taken by the rank that wrote it:
    publishing then never reads the checkpoint back on one rank)."""
    rank = engine.topology.rank
    files = list(engine.strategy.save(staging, rank, exclude_frozen_parameters))  # type: ignore[union-attr]
    ckpt_io.save_tensors(staging / _rng_file(rank), stream_states(engine.module))
    files.append(_rng_file(rank))
    if rank == 0:
        files += _save_engine_state(engine, staging, client_state, tag)
    return {name: ckpt_io.file_entry(staging / name) for name in files}


def _publish(staging: Path, save_dir: Path, tag: str, records: dict[str, dict[str, Any]], save_latest: bool) -> None:
    ckpt_io.write_manifest(staging, sorted(records), known=records)
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


def _gather_records(engine: "DeepShardEngine", records: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every rank's file records on global rank 0, which writes the manifest ({} on the other ranks: a
    gather, not an all-gather, so no rank but the publisher receives the O(world size) list)."""
    import torch.distributed as dist

    world = engine.topology.world
    if world.size == 1:
        return records
    gathered: list[Any] | None = [None] * world.size if world.rank == 0 else None
    dist.gather_object(records, gathered, dst=world.peers[0], group=world.group)
    return {name: rec for part in (gathered or []) for name, rec in part.items()}


def _save_engine_state(engine: "DeepShardEngine", directory: Path, client_state: dict[str, Any],
                       tag: str) -> list[str]:
    state = {
        "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "client_state": client_state,
    }
    tensors, skeleton = flatten_state(state)
    meta = {
        "format": "deepshard-engine", "version": FORMAT_VERSION, "tag": tag,
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
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


def load_engine_checkpoint(engine: "DeepShardEngine", load_dir: Path, tag: str | None, strict: bool,
                           load_optimizer_states: bool, load_lr_scheduler_states: bool,
                           load_module_only: bool) -> tuple[str | None, dict | None]:
    from deepshard.checkpoint.deepspeed_format import deepspeed_tag_dir, load_deepspeed_checkpoint

    ds_tag = deepspeed_tag_dir(load_dir, tag)
    if ds_tag is not None:  # a directory DeepSpeed's save_checkpoint wrote: read as it is, no pickle run
        return load_deepspeed_checkpoint(engine, ds_tag, strict, load_optimizer_states, load_lr_scheduler_states,
                                         load_module_only)
    if tag is None:
        tag = ckpt_io.read_latest(load_dir)
        if tag is None:
            logger.warning("no 'latest' file in %s: nothing loaded; pass tag=... to load a specific "
                           "checkpoint", load_dir)
            return None, None
    path = load_dir / str(tag)
    _recover_interrupted_publication(engine, load_dir, str(tag))
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist; tags in {load_dir}: "
                                f"{sorted(p.name for p in load_dir.iterdir() if p.is_dir() and not p.name.startswith('.'))}")
    error: Exception | None = None
    loaded: tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor] | None] | None = None
    try:  # every file this rank reads is checked against the manifest as it is read (checkpoint/verify.py)
        with ledger.verifying(ManifestVerifier(path)) as verifier:
            loaded = _read_rank_part(engine, path, verifier.names(), strict, load_optimizer_states and not load_module_only)
    except Exception as err:  # noqa: BLE001 - agreed with every rank below, then raised
        error = err
    agree_on_load(engine.topology.world, f"reading {path}", error)  # raises on every rank if any failed
    if loaded is None:
        raise ckpt_io.CheckpointError(f"reading {path} returned nothing and raised nothing")  # unreachable
    meta, state, rng = loaded
    if load_module_only:
        return str(path), state.get("client_state", {})
    engine.global_steps = int(meta["global_steps"])
    engine.global_samples = int(meta["global_samples"])
    # realign the micro-step counter with *this* run's accumulation steps (they may differ from the saver's)
    engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    engine.skipped_steps = int(meta["skipped_steps"])
    engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("scheduler") is not None:
        engine.lr_scheduler.load_state_dict(state["scheduler"])
    if rng is not None:
        restore_streams(engine.module, rng)  # deepshard's streams; not torch's
    engine.topology.world.barrier()
    return str(path), state.get("client_state", {})


def _read_rank_part(engine: "DeepShardEngine", path: Path, listed: list[str], strict: bool, with_optimizer: bool
                    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor] | None]:
    """This rank's part of a load: the engine file, the strategy's own files (it loads them into the model
    and optimizer), the engine state and this rank's RNG streams. Returns ``(meta, state, rng or None)``."""
    meta = schema.check(path / ENGINE_JSON, ckpt_io.load_json(path / ENGINE_JSON), schema.ENGINE, "engine file")
    rng_path = path / _rng_file(engine.topology.rank)
    dims = engine.topology.dims
    saved = {"sp": 1, **meta.get("grid", {"pp": 1, "dp": meta.get("dp_world_size", -1), "tp": 1})}
    same_grid = saved == {"pp": dims.pp, "dp": dims.dp, "tp": dims.tp, "sp": dims.sp}
    rng_saved = any(name.startswith("rng_rank") for name in listed)  # not by converters from DeepSpeed
    if same_grid and rng_saved and rng_path.name not in listed:
        raise ckpt_io.CheckpointError(f"checkpoint {path} is incomplete: {rng_path.name} (rank "
                                      f"{engine.topology.rank}'s RNG state; the other ranks' are there) is missing; "
                                      "load another tag")
    engine.strategy.load(path, with_optimizer, strict)  # type: ignore[union-attr]
    try:
        state = unflatten_state(ckpt_io.load_tensors(path / ENGINE_TENSORS), meta["state"])
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise ckpt_io.CheckpointError(f"{path / ENGINE_JSON}'s 'state' does not describe {path / ENGINE_TENSORS} "
                                      f"({type(err).__name__}: {err}): the files are from different saves or "
                                      "edited; load another tag") from err
    rng = ckpt_io.load_tensors(rng_path) if same_grid and rng_saved else None
    return meta, state, rng


def _recover_interrupted_publication(engine: "DeepShardEngine", load_dir: Path, tag: str) -> None:
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


def consolidated_16bit_state_dict(engine: "DeepShardEngine", exclude_frozen_parameters: bool = False
                                  ) -> dict[str, torch.Tensor]:
    """The full module state dict in its compute dtype on rank 0 ({} on other ranks under ZeRO-3, where
    building it is a collective every rank must join)."""
    strategy = engine.strategy
    if hasattr(strategy, "consolidated_state_dict"):
        return strategy.consolidated_state_dict(engine.comm.rank, exclude_frozen_parameters)  # type: ignore[union-attr]
    frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
    return {k: v.detach().cpu() for k, v in engine.module.state_dict().items()
            if not (exclude_frozen_parameters and k in frozen)}


def save_16bit_model(engine: "DeepShardEngine", save_dir: Path, filename: str,
                     exclude_frozen_parameters: bool) -> bool:
    if engine.zero_optimization_stage() == 3 and not engine.zero_gather_16bit_weights_on_model_save():
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
