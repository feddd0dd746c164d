"""Progress for long work (checkpoint consolidation and loading, large saves, the autotuner's trials).

On a terminal a tqdm bar shows done of total, elapsed time, rate and the time left; where output goes to
a file or a pipe (CI logs, ``> train.log``) the bar is off, so logs hold no ``\\r`` redraws. The
``deepshard`` launcher run on a terminal turns the bars on for its rank 0 (it forwards ``\\r`` as it
comes). ``DEEPSHARD_PROGRESS=1`` forces the bars on, ``=0`` off.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
PROGRESS_ENV = "DEEPSHARD_PROGRESS"


def bars_on(stream: Any = None) -> bool:
    """Whether progress bars are shown: never on a rank other than 0 (``RANK``), else
    ``DEEPSHARD_PROGRESS`` if set (the launcher sets it to 1 for its ranks when it runs on a terminal),
    else whether ``stream`` (stderr) is a terminal."""
    if os.environ.get("RANK", "0") != "0":
        return False
    forced = os.environ.get(PROGRESS_ENV, "")
    if forced in ("0", "1"):
        return forced == "1"
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)())


def progress(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it",
             enabled: bool = True, unit_scale: bool = False) -> Iterator[T]:
    """``items`` with a tqdm bar (when ``enabled`` and :func:`bars_on`), else ``items`` unchanged."""
    if not (enabled and bars_on()):
        yield from items
        return
    from tqdm import tqdm

    with tqdm(items, desc=desc, total=total, unit=unit, unit_scale=unit_scale, leave=False,
              file=sys.stderr, dynamic_ncols=True) as bar:
        yield from bar


def format_seconds(seconds: float) -> str:
    """``75.4`` -> ``1m15s``; ``4000`` -> ``1h06m``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
