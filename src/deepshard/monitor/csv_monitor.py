"""CSV monitor: one file per event name, in DeepSpeed's layout.

Files live in ``output_path/job_name/``; the event ``Train/Samples/train_loss`` goes to
``Train_Samples_train_loss.csv`` ('/' and ' ' become '_'). The header row is ``step,<last part of
the name>`` (``step,train_loss``) and each event appends a row ``<step>,<value>``. Unlike DeepSpeed,
the header is written only when the file is new or empty, so a resumed run appends to the same
table without repeating the header.
"""
from __future__ import annotations

import csv
from pathlib import Path

from deepshard.monitor.base import DEFAULT_JOB_NAME, log_dir, normalize_events

__all__ = ["CSVMonitor", "csv_file_name"]


def csv_file_name(event_name: str) -> str:
    """The file an event is written to, e.g. ``Train/Samples/lr`` -> ``Train_Samples_lr.csv``."""
    return event_name.replace("/", "_").replace(" ", "_") + ".csv"


class CSVMonitor:
    """Appends events to ``<output_path>/<job_name>/<event name>.csv``."""

    def __init__(self, output_path: str | Path = "", job_name: str = DEFAULT_JOB_NAME) -> None:
        self.log_dir = log_dir(output_path, job_name)
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """Append one row per event; events with the same name keep their order."""
        by_file: dict[str, list[tuple[str, float, int]]] = {}
        for event in normalize_events(events):
            by_file.setdefault(csv_file_name(event[0]), []).append(event)
        for file_name, rows in by_file.items():
            path = self.log_dir / file_name
            with open(path, "a", newline="", encoding="utf-8") as f:
                writer = csv.writer(f)
                if f.tell() == 0:
                    writer.writerow(["step", rows[0][0].rsplit("/", 1)[-1]])
                writer.writerows([step, value] for _, value, step in rows)

    def close(self) -> None:
        """Nothing to release: every write opens and closes its file."""
