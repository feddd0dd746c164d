"""deepshard's side of the DeepSpeed checkpoint tests, run in ``run_world`` ranks: load DeepSpeed's
directories at this world's layout and train on (the model, data and steps of ``ds_worker.py``)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tests.deepspeed_compat import ds_worker

Case = tuple[str, str, int, str, bool]  # (label, directory, deepshard ZeRO stage, dtype, pipeline)


def _case_args(stage: int, dtype: str, pipeline: bool, world: int) -> argparse.Namespace:
    return argparse.Namespace(library="deepshard", stage=stage, dtype=dtype, pipeline=pipeline,
                              dp=world // 2 if pipeline else world)


def load_and_train(rank: int, world: int, cases: list[Case]) -> dict[str, Any]:
    """For each case: a fresh deepshard engine loads the directory and trains 3 steps."""
    import deepshard

    out: dict[str, Any] = {}
    for label, directory, stage, dtype, pipeline in cases:
        args = _case_args(stage, dtype, pipeline, world)
        engine = ds_worker._engine(deepshard, args)
        # a pipeline's checkpoint into the plain model or back: the plain model's extra buffer is not
        # in the pipeline's (it keeps its initial value; the pipeline ignores it)
        strict = label.startswith("pipe") == pipeline
        _, client = engine.load_checkpoint(directory, load_module_strict=strict)
        losses = [ds_worker._step(engine, args, rank) for _ in range(3)]
        out[label] = {"losses": losses, "client_state": {k: client.get(k) for k in ("epoch", "note")},
                      "global_steps": engine.global_steps, "global_samples": engine.global_samples}
        engine.destroy()
    return out


def save_then_resume(rank: int, world: int, directory: str, stage: int) -> dict[str, Any]:
    """deepshard trains 3 steps and saves (its own format), then a fresh engine resumes 3 steps."""
    import deepshard

    args = _case_args(stage, "fp32", False, world)
    engine = ds_worker._engine(deepshard, args)
    first = [ds_worker._step(engine, args, rank) for _ in range(3)]
    engine.save_checkpoint(directory, client_state={"epoch": 3, "note": "hello"})
    engine.destroy()
    engine = ds_worker._engine(deepshard, args)
    engine.load_checkpoint(directory)
    resumed = [ds_worker._step(engine, args, rank) for _ in range(3)]
    engine.destroy()
    return {"first": first, "resumed": resumed, "dir": str(Path(directory))}
