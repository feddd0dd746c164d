"""What each rank runs for the tools tests: the flops_profiler section, timers and throughput."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import deepshard
from deepshard.utils.logging import logger
from tests.multiproc.models import make_token_batches, make_transformer, optimizer_config
from tests.multiproc.scenarios_stage0 import run_steps


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def profiled_training(rank: int, world: int, tmp: str) -> dict[int, dict[str, Any]]:
    """The run below under ZeRO-0 and ZeRO-3, in one world."""
    return {stage: _profiled_training(rank, world, tmp, stage) for stage in (0, 3)}


def _profiled_training(rank: int, world: int, tmp: str, stage: int) -> dict[str, Any]:
    """Three steps (2 micro-steps each) of the tied, twice-called TinyTransformer with the profiler at
    step 1, wall_clock_breakdown, steps_per_print 1 and the CSV monitor."""
    micro, gas = 2, 2
    out_dir = Path(tmp) / f"stage{stage}"
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "optimizer": optimizer_config(), "zero_optimization": {"stage": stage},
           "wall_clock_breakdown": True, "steps_per_print": 1,
           "csv_monitor": {"enabled": True, "output_path": str(out_dir), "job_name": "tools"},
           "flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": 2, "top_modules": 2,
                              "output_file": str(out_dir / "flops.txt")}}
    handler = _Lines()
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        engine, *_ = deepshard.initialize(model=make_transformer(), config=cfg)
        losses = run_steps(engine, make_token_batches(3, micro * gas * world), micro, gas, rank, world)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    tools = engine.tools
    result = {"flops_per_step": tools.flops_per_step, "lines": handler.lines, "losses": losses, "rates": tools.rates(world),
              "tokens_per_step": tools.tokens_per_step, "profiler_started": getattr(engine.flops_profiler, "started", None),
              "hooks_left": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in engine.module.modules())
              if stage == 0 else 0}
    engine.destroy()
    return result
