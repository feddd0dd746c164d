"""``engine.load_checkpoint`` on a directory DeepSpeed wrote: the engine's counters, loss scaler, LR
scheduler and client state from the model-states file; the weights and optimizer state through the
strategy's own any-layout loading (``load_full_state`` reads DeepSpeed's files into the same
:class:`FullState` a deepshard checkpoint gives), so any data-parallel size and ZeRO stage load it.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepshard.checkpoint.deepspeed_format.read import read_engine_record
from deepshard.utils.logging import logger

if TYPE_CHECKING:
    from deepshard.engine import DeepShardEngine


def load_deepspeed_checkpoint(engine: "DeepShardEngine", tag_dir: Path, strict: bool, load_optimizer_states: bool,
                              load_lr_scheduler_states: bool, load_module_only: bool) -> tuple[str, dict[str, Any]]:
    record = read_engine_record(tag_dir)
    logger.info("loading DeepSpeed checkpoint %s (ZeRO stage %d, written by %d data-parallel ranks)",
                tag_dir, record.zero_stage, record.dp_world_size)
    engine.strategy.load(tag_dir, load_optimizer_states and not load_module_only, strict)  # type: ignore[union-attr]
    if load_module_only:
        return str(tag_dir), record.client_state
    engine.global_steps = record.global_steps
    engine.global_samples = record.global_samples
    engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    engine.skipped_steps = record.skipped_steps
    _load_scaler(engine, record.loss_scaler)
    if load_lr_scheduler_states and engine.lr_scheduler is not None and record.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(record.lr_scheduler)
    engine.topology.world.barrier()
    return str(tag_dir), record.client_state


def _load_scaler(engine: "DeepShardEngine", state: dict[str, Any]) -> None:
    """The saved scale when the run scales the same way (static or dynamic); a run that changed (bf16
    saved, fp16 resumed) keeps its configured scaler, as it would starting afresh."""
    current = engine.loss_scaler.state_dict()
    if current.get("kind") == state.get("kind"):
        engine.loss_scaler.load_state_dict(state)
    else:
        logger.info("the DeepSpeed checkpoint's loss scaler is %s, this run's %s: keeping this run's",
                    state.get("kind"), current.get("kind"))
