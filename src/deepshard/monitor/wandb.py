"""Weights & Biases monitor: ``wandb.log({name: value}, step=step)`` for each event."""
from __future__ import annotations

from typing import Any

from deepshard.monitor.base import normalize_events

__all__ = ["WandbMonitor"]


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as err:
        raise ImportError(
            "the wandb monitor is enabled (\"wandb\": {\"enabled\": true}) but the `wandb` package is "
            "not installed: run `pip install wandb` (from a deepshard checkout: `pip install '.[wandb]'`) and "
            "`wandb login`, or set wandb.enabled to false in the config") from err
    return wandb


class WandbMonitor:
    """Logs events to a W&B run: ``wandb.init(project=project, group=group, entity=team)``.

    If the script already started a run (``wandb.run`` is set), events go to that run and
    :meth:`close` leaves it open; a run started here is finished by :meth:`close`.
    """

    def __init__(self, group: str | None = None, team: str | None = None,
                 project: str = "deepspeed") -> None:
        self._wandb = _import_wandb()
        existing = getattr(self._wandb, "run", None)
        self._owns_run = existing is None
        self._run: Any = existing if existing is not None else self._wandb.init(
            project=project, group=group, entity=team)

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """Log each event as ``{name: value}`` at ``step``."""
        if self._run is None:
            raise RuntimeError("WandbMonitor was closed; create a new one")
        for name, value, step in normalize_events(events):
            self._run.log({name: value}, step=step)

    def close(self) -> None:
        """Finish the run if this monitor started it."""
        if self._run is not None and self._owns_run:
            self._run.finish()
        self._run = None
