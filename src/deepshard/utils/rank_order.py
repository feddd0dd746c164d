"""Sections where the ranks run one after another (Accelerate's ``main_process_first``), and the
refusal of collectives inside them.

A collective needs every rank at once; inside a rank-ordered section rank 0 runs alone while the others
wait at a barrier, so a collective there hangs (accelerate #3709: ``main_process_first`` around a ZeRO-3
model build). Code that would start collectives calls :func:`refuse_collectives_here` and fails at once
with the reason; the launcher then stops the waiting ranks, instead of every rank waiting forever.
The sections are per thread and held by whoever enters them (no process-group state here).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_LOCAL = threading.local()


@contextlib.contextmanager
def rank_ordered_section(name: str) -> Iterator[None]:
    """Mark the block as run by the ranks in turn (``name`` says whose block it is, for the error)."""
    stack: list[str] = _LOCAL.__dict__.setdefault("names", [])
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


def refuse_collectives_here(what: str) -> None:
    """Raise if this thread is inside a rank-ordered section: ``what`` would hang there."""
    names = getattr(_LOCAL, "names", None)
    if names:
        raise RuntimeError(
            f"{what} runs collectives on all ranks together, but this rank is inside {names[-1]}, where the "
            "ranks run one after another, so it would hang (rank 0 waits for ranks still at the barrier). "
            "Build the model and load its weights outside that block (keep data preparation inside it)")
