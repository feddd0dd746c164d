"""Loading an engine from a tag of either format: the tag's one reader (``reader.py``) chosen from what
the directory holds, every rank reading its own part (verified against the manifest as it is read, for a
deepshard tag) and the ranks agreeing on the outcome before anything of the engine changes; then the
weights into the strategy, the counters, the loss scaler, the LR scheduler and the RNG streams. Loading
never unpickles.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

from deepshard.checkpoint import io as ckpt_io
from deepshard.checkpoint.collective import agree_on_load
from deepshard.checkpoint.deepspeed_format.detect import deepspeed_tag_dir
from deepshard.checkpoint.engine_checkpoint import CheckpointedEngine
from deepshard.checkpoint.layout import module_splits
from deepshard.checkpoint.module_state import check_model_names
from deepshard.checkpoint.reader import DeepShardTag, DeepSpeedTag, Resume, TagReader
from deepshard.checkpoint.rng_streams import restore_streams
from deepshard.checkpoint.share import LoadShare
from deepshard.shard_state import FullState
from deepshard.utils.logging import log_rank0, logger

# 1: load_checkpoint with nothing to load (no directory, no 'latest') raises instead of warning (docs/checkpoints.md)
REQUIRE_ENV = "DEEPSHARD_REQUIRE_CHECKPOINT"


def load_engine_checkpoint(engine: CheckpointedEngine, load_dir: Path, tag: str | None, strict: bool,
                           load_optimizer_states: bool, load_lr_scheduler_states: bool,
                           load_module_only: bool) -> tuple[str | None, dict | None]:
    """Load a tag of either format through its one reader (``checkpoint/reader.py``): its engine record read,
    the weights checked against the model's names and handed to the strategy (every rank reads its own
    part; the ranks agree on the outcome), then the counters, the loss scaler, the LR scheduler and the RNG
    streams."""
    reader = _open_for_load(engine, load_dir, tag)
    if reader is None:
        return _nothing_to_load(engine.topology.rank, load_dir, tag)
    with_optimizer = load_optimizer_states and not load_module_only
    resume = _read_agreed(engine, reader, strict, with_optimizer)
    if not load_module_only:
        _apply_resume(engine, resume, load_lr_scheduler_states)
        engine.topology.world.barrier()
    return str(reader.path), resume.client_state


def _read_part(engine: CheckpointedEngine, reader: TagReader, strict: bool,
               with_optimizer: bool) -> tuple[Resume, FullState]:
    """This rank's part of a load, read and checked, nothing of the engine changed yet: the engine record
    and the weights (and optimizer state), their names checked against the model."""
    full = reader.full_state(engine.module, with_optimizer, _share(engine, reader, with_optimizer))
    resume = reader.resume(engine.topology.rank, engine.topology.dims)  # after: from the files the share read
    check_model_names(engine.module, full, strict, reader.path)
    return resume, full


def _share(engine: CheckpointedEngine, reader: TagReader, with_optimizer: bool) -> Optional[LoadShare]:
    """What this rank's strategy loads of each tensor (None: everything), for the reader to read only that.
    Restoring optimizer state, the file the engine names as this rank's optimizer-state file is read first
    (a module-only load does not ask the engine for it)."""
    ranges = engine.strategy.load_share()
    if ranges is None:
        return None
    first = None
    if with_optimizer and isinstance(reader, DeepShardTag):
        first = Path(engine._get_optimizer_ckpt_name(reader.path.parent, reader.path.name)).name
    return LoadShare(ranges, module_splits(engine.module), engine.topology.rank, first_file=first)


def _read_agreed(engine: CheckpointedEngine, reader: TagReader, strict: bool, with_optimizer: bool) -> Resume:
    """``_read_part`` inside the reader's verifying block; for a verified tag every file a rank reads is
    checked as it is read, and when any rank failed every rank raises (``collective.agree_on_load``).
    Only then are the weights handed to the strategy: its ``load_state`` may run collectives (ZeRO 1-2
    all-gather what a rank did not read), which a rank that failed to read would never join."""
    if not reader.verified:
        resume, full = _read_part(engine, reader, strict, with_optimizer)
    else:
        error: Exception | None = None
        part: tuple[Resume, FullState] | None = None
        try:
            with reader.verifying():
                part = _read_part(engine, reader, strict, with_optimizer)
        except Exception as err:  # noqa: BLE001 - agreed with every rank below, then raised
            error = err
        agree_on_load(engine.topology.world, f"reading {reader.path}", error)  # raises on every rank if any failed
        if part is None:
            raise ckpt_io.CheckpointError(f"reading {reader.path} returned nothing and raised nothing")  # unreachable
        resume, full = part
    engine.strategy.load_state(full, with_optimizer)
    return resume


def _open_for_load(engine: CheckpointedEngine, load_dir: Path, tag: str | None) -> Optional[TagReader]:
    """The reader of the tag ``load_checkpoint(load_dir, tag)`` means (``load_dir/latest`` without a tag), or
    None when there is nothing to load (no directory, or no ``latest``)."""
    ds_tag = deepspeed_tag_dir(load_dir, tag)
    if ds_tag is not None:  # a directory DeepSpeed's save_checkpoint wrote: read as it is, no pickle run
        return DeepSpeedTag(ds_tag)
    if not load_dir.is_dir():
        return None
    if tag is None:
        tag = ckpt_io.read_latest(load_dir)
        if tag is None:
            return None
    path = load_dir / str(tag)
    _recover_interrupted_publication(engine, load_dir, str(tag))
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist; tags in {load_dir}: "
                                f"{sorted(p.name for p in load_dir.iterdir() if p.is_dir() and not p.name.startswith('.'))}")
    return DeepShardTag(path)


def _apply_resume(engine: CheckpointedEngine, resume: Resume, load_lr_scheduler_states: bool) -> None:
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
    if resume.rng is not None:
        restore_streams(engine.module, resume.rng)  # deepshard's streams; not torch's


def require_checkpoint(environ: Any = os.environ) -> bool:
    """Whether ``DEEPSHARD_REQUIRE_CHECKPOINT`` asks ``load_checkpoint`` to raise when it finds nothing to load."""
    value = environ.get(REQUIRE_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{REQUIRE_ENV}={value!r} is not 0 or 1; set 1 to make load_checkpoint raise when "
                         "there is no checkpoint to load, or unset it")
    return value == "1"


def _nothing_to_load(rank: int, load_dir: Path, tag: str | None) -> tuple[None, None]:
    """``(None, None)`` with one warning (rank 0) that says plainly what is missing, or, under
    ``DEEPSHARD_REQUIRE_CHECKPOINT=1``, a FileNotFoundError saying it on every rank."""
    where = load_dir.absolute()
    if not load_dir.exists():
        why = f"the checkpoint directory {where} does not exist"
    elif not load_dir.is_dir():
        why = f"{where} is a file, not a checkpoint directory"
    else:
        tags = sorted(p.name for p in load_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
        why = (f"{where} has no 'latest' file naming the tag to load; pass tag=... to load one of the "
               f"checkpoints there ({', '.join(tags) or 'none'})")
    if tag is not None:  # an explicit tag in a directory that is not there is always an error
        raise FileNotFoundError(f"load_checkpoint(tag={tag!r}): {why}")
    if require_checkpoint():
        raise FileNotFoundError(f"load_checkpoint: {why} ({REQUIRE_ENV}=1 makes this an error; unset it to "
                                "start from the model's initial state when there is nothing to load)")
    log_rank0(f"load_checkpoint: {why}: nothing loaded, training starts from the model's initial state "
              f"({REQUIRE_ENV}=1 makes this an error)", rank, logging.WARNING)
    return None, None


def _recover_interrupted_publication(engine: CheckpointedEngine, load_dir: Path, tag: str) -> None:
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
