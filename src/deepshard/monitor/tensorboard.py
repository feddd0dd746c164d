"""TensorBoard monitor: ``torch.utils.tensorboard.SummaryWriter`` in ``output_path/job_name``."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from deepshard.monitor.base import DEFAULT_JOB_NAME, log_dir, normalize_events

__all__ = ["TensorBoardMonitor"]


def _summary_writer_class() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ImportError(
            "the tensorboard monitor is enabled (\"tensorboard\": {\"enabled\": true}) but the "
            "`tensorboard` package is not installed: run `pip install tensorboard` (or "
            "from a deepshard checkout `pip install '.[tensorboard]'`), or set tensorboard.enabled to false in the "
            f"config ({err})") from err
    return SummaryWriter


class TensorBoardMonitor:
    """Writes each event as a scalar (``add_scalar(name, value, step)``) and flushes per batch."""

    def __init__(self, output_path: str | Path = "", job_name: str = DEFAULT_JOB_NAME) -> None:
        writer_cls = _summary_writer_class()
        self.log_dir = log_dir(output_path, job_name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer: Any = writer_cls(log_dir=str(self.log_dir))

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """Add every event as a scalar and flush, so TensorBoard shows it at once."""
        if self._writer is None:
            raise RuntimeError(f"TensorBoardMonitor for {self.log_dir} was closed; create a new one")
        for name, value, step in normalize_events(events):
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
