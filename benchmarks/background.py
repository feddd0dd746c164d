"""Reproducible CPU contention for the benchmarks: ``--background-load N`` runs N busy processes beside
the engines for the whole measurement.

Each is a pure-Python spin loop (no torch, no threads, a few KiB of memory) at the driver's own nice
level, so the engines' ranks and the load share the cores as equals: the case of a data-loader worker,
a second job or a busy node on a shared machine. The processes lead their own sessions and are killed
when the measurement ends (also when it fails).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Iterator

# a loop that computes and never sleeps or allocates: pure contention for a core, nothing else
_SPIN = "x = 0\nwhile True:\n    x = (x * 1103515245 + 12345) & 0xFFFFFFFF\n"


def start_load(n: int) -> list[subprocess.Popen]:
    """Start ``n`` spinning processes (same nice level as this one)."""
    if n < 0:
        raise ValueError(f"--background-load ({n}) must be >= 0 busy processes")
    return [subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True) for _ in range(n)]


def stop_load(procs: list[subprocess.Popen]) -> None:
    """Kill the processes ``start_load`` started (each by its own process group, nothing else)."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()


@contextlib.contextmanager
def background_load(n: int) -> Iterator[list[subprocess.Popen]]:
    """``n`` busy processes for the duration of the ``with`` block."""
    procs = start_load(n)
    try:
        yield procs
    finally:
        stop_load(procs)
