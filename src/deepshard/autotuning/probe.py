"""The engine's side of an autotuning trial: measure, write the metrics, end the run.

The tuner starts each trial with ``DEEPSHARD_AUTOTUNING`` naming a JSON file ``{"metric_path": ...,
"start_step": S, "end_step": E, "model_info": bool}``. The engine then times optimizer steps ``S+1 .. E``
(the first steps warm up), rank 0 writes ``{"throughput": samples/s, "latency": s/step, ...}`` to
``metric_path`` and every rank exits with status 0 at step ``E``, as DeepSpeed's autotuning does, so a
trial of any training script is short. With ``model_info`` the run stops after its first step and
records the model's parameter counts instead (what the tuner prunes with).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from deepshard.profiling.memory_estimator import ModelFacts

ENV = "DEEPSHARD_AUTOTUNING"


class AutotuneProbe:
    """Built by the engine when ``DEEPSHARD_AUTOTUNING`` is set; ``after_step`` at every boundary."""

    def __init__(self, metric_path: str, start_step: int, end_step: int, model_info: bool) -> None:
        self.metric_path = Path(metric_path)
        self.start_step, self.end_step, self.model_info = start_step, end_step, model_info
        self._t0: Optional[float] = None
        self._samples0 = 0

    @classmethod
    def from_env(cls) -> Optional["AutotuneProbe"]:
        path = os.environ.get(ENV)
        if not path:
            return None
        spec = json.loads(Path(path).read_text())
        return cls(spec["metric_path"], int(spec["start_step"]), int(spec["end_step"]), bool(spec.get("model_info")))

    def after_step(self, engine: Any) -> None:
        step = int(engine.global_steps)
        if self.model_info:
            self._finish(engine, {"model_info": asdict(ModelFacts.of(engine.module))})
        if step == self.start_step:
            engine.accelerator.synchronize()
            self._t0, self._samples0 = time.perf_counter(), int(engine.global_samples)
        elif step == self.end_step and self._t0 is not None:
            engine.accelerator.synchronize()
            elapsed = time.perf_counter() - self._t0
            samples = int(engine.global_samples) - self._samples0
            self._finish(engine, {"throughput": samples / elapsed, "latency": elapsed / (step - self.start_step),
                                  "steps": step - self.start_step, "samples": samples,
                                  "max_memory_allocated": int(engine.accelerator.max_memory_allocated())})

    def _finish(self, engine: Any, metrics: dict[str, Any]) -> None:
        if engine.global_rank == 0:
            self.metric_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.metric_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(metrics))
            tmp.replace(self.metric_path)
        engine.topology.world.barrier("the end of an autotuning trial")
        raise SystemExit(0)
