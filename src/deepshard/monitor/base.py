"""What every monitor backend shares: the protocol, the event format, the log directory.

An event is DeepSpeed's tensorboard-style triple ``(name, value, step)``, e.g.
``("Train/Samples/train_loss", 2.31, 4096)``; the engine uses the number of samples seen so far as
the step, as DeepSpeed does.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Protocol, runtime_checkable

__all__ = ["Monitor", "Event", "DEFAULT_JOB_NAME", "log_dir", "normalize_events", "TRAIN_LOSS", "LR",
           "LOSS_SCALE", "ELAPSED_FORWARD", "ELAPSED_BACKWARD", "ELAPSED_BACKWARD_INNER",
           "ELAPSED_BACKWARD_ALLREDUCE", "ELAPSED_STEP"]

Event = tuple[str, float, int]
DEFAULT_JOB_NAME = "DeepSpeedJobName"

# The event names DeepSpeed's engine writes (its monitor documentation lists them).
TRAIN_LOSS = "Train/Samples/train_loss"
LR = "Train/Samples/lr"
LOSS_SCALE = "Train/Samples/loss_scale"
ELAPSED_FORWARD = "Train/Samples/elapsed_time_ms_forward"
ELAPSED_BACKWARD = "Train/Samples/elapsed_time_ms_backward"
ELAPSED_BACKWARD_INNER = "Train/Samples/elapsed_time_ms_backward_inner"
ELAPSED_BACKWARD_ALLREDUCE = "Train/Samples/elapsed_time_ms_backward_allreduce"
ELAPSED_STEP = "Train/Samples/elapsed_time_ms_step"


@runtime_checkable
class Monitor(Protocol):
    """A sink for scalar training events."""

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """Record each ``(name, value, step)``."""

    def close(self) -> None:
        """Flush and release files or connections; idempotent."""


def log_dir(output_path: str | Path, job_name: str) -> Path:
    """The directory a file-based monitor writes to: ``output_path/job_name``.

    As in DeepSpeed, the default ``output_path`` ``""`` means the current working directory, so the
    files land in ``./<job_name>/`` (``./DeepSpeedJobName/`` by default). ``~`` is expanded.
    """
    parts = Path(job_name).parts if isinstance(job_name, str) else ()
    if not parts or Path(job_name).is_absolute() or ".." in parts:
        raise ValueError(f"monitor job_name {job_name!r} must be a non-empty relative directory name "
                         f"without '..', e.g. {DEFAULT_JOB_NAME!r}; put parent directories in "
                         "output_path")
    return Path(output_path or ".").expanduser() / job_name


def normalize_events(events: Iterable[Any]) -> list[Event]:
    """Check and convert events to ``(str, float, int)``; 0-d tensors and numpy scalars are accepted."""
    out: list[Event] = []
    for i, event in enumerate(events):
        try:
            name, value, step = event
        except (TypeError, ValueError) as err:
            raise ValueError(f"monitor event #{i} is {event!r}; each event must be a "
                             "(name, value, step) triple like ('Train/Samples/train_loss', 2.3, 64)"
                             ) from err
        if not isinstance(name, str) or not name:
            raise ValueError(f"monitor event #{i} has name {name!r}; the name must be a non-empty str")
        try:
            out.append((name, float(value), int(step)))
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"monitor event {name!r} has value {value!r} and step {step!r}; the "
                             "value must be a number (or 0-d tensor) and the step an int") from err
    return out
