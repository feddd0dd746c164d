"""Every tick of DeepSpeed's pipeline schedule classes as text, for sizes up to 4 stages and 8 micro-batches
(imported by DeepSpeed's python too, so no pytest here)."""
from __future__ import annotations

from types import ModuleType

CLASSES = ("TrainSchedule", "InferenceSchedule", "DataParallelSchedule")


def dump(schedule: ModuleType) -> list[str]:
    """One line per (class, stages, micro-batches, stage): its buffer count and each tick's instructions."""
    lines = []
    for stages in (1, 2, 3, 4):
        for micro_batches in (1, 2, 3, 5, 8):
            for stage in range(stages):
                for name in CLASSES:
                    sched = getattr(schedule, name)(micro_batches=micro_batches, stages=stages, stage_id=stage)
                    ticks = " | ".join(repr(cmds) for cmds in sched)
                    lines.append(f"{name} S={stages} m={micro_batches} s={stage} "
                                 f"buffers={sched.num_pipe_buffers()}: {ticks}")
    return lines
