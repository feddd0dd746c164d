"""MonitorMaster: fans events out to the enabled backends, on rank 0 only."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepshard.monitor.base import DEFAULT_JOB_NAME, Monitor, normalize_events
from deepshard.monitor.csv_monitor import CSVMonitor
from deepshard.monitor.tensorboard import TensorBoardMonitor
from deepshard.monitor.wandb import WandbMonitor

__all__ = ["MonitorMaster"]


def _field(config: Any, name: str, default: Any) -> Any:
    """``config.name`` for a config object, ``config[name]`` for a dict; ``default`` for None."""
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _open_file_monitor(key: str, section: Any, backend: Any) -> Monitor:
    """A file-based backend; a directory it cannot create is reported with the config key."""
    output_path = _field(section, "output_path", "") or ""
    job_name = _field(section, "job_name", DEFAULT_JOB_NAME)
    try:
        return backend(output_path, job_name)
    except OSError as err:
        where = err.filename or output_path or "."
        raise ValueError(f"{key}.output_path = {output_path!r}: cannot create the log directory {where!r} "
                         f"({err.strerror or err}); give a writable directory in {key}.output_path, or set "
                         f"{key}.enabled to false") from err


class MonitorMaster:
    """The engine's monitor: the ``tensorboard``, ``csv_monitor`` and ``wandb`` config sections.

    Each section is a config object (or dict, or None for "disabled") with ``enabled``,
    ``output_path`` and ``job_name`` (wandb: ``group``, ``team``, ``project``). Only rank 0 creates
    backends and writes; on other ranks this object does nothing. ``enabled`` is True when this
    process will write something, so the engine can skip building events elsewhere.
    """

    def __init__(self, tensorboard: Any, csv_monitor: Any, wandb: Any, rank: int) -> None:
        self.rank = rank
        self.monitors: list[Monitor] = []
        if rank != 0:
            return
        for key, section, backend in (("tensorboard", tensorboard, TensorBoardMonitor),
                                      ("csv_monitor", csv_monitor, CSVMonitor)):
            if _field(section, "enabled", False):
                self.monitors.append(_open_file_monitor(key, section, backend))
        if _field(wandb, "enabled", False):
            self.monitors.append(WandbMonitor(
                _field(wandb, "group", None), _field(wandb, "team", None),
                _field(wandb, "project", "deepspeed")))

    @property
    def enabled(self) -> bool:
        """True when at least one backend writes in this process (rank 0 with a monitor enabled)."""
        return bool(self.monitors)

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """Send ``(name, value, step)`` events to every backend; a no-op off rank 0."""
        if not self.monitors:
            return
        checked = normalize_events(events)
        for monitor in self.monitors:
            monitor.write_events(checked)

    def close(self) -> None:
        """Close every backend; further writes are ignored."""
        monitors, self.monitors = self.monitors, []
        for monitor in monitors:
            monitor.close()
