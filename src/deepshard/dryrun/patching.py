"""Swapping functions for a dry run's duration: wherever a function is reachable by name in
``torch.distributed`` and deepshard's modules (including the aliases some modules keep, such as
``_reduce_scatter = dist.reduce_scatter_single``, and ``deepspeed`` when deepshard stands in for it).
Only the dry run does this, inside its own process, and it undoes every swap when it ends."""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch.distributed as dist


def _owners() -> list[Any]:
    found = [dist]
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "deepshard" or name.startswith("deepshard.") or name == "deepspeed"):
            found.append(module)
    return found


@contextlib.contextmanager
def swapped(replacements: dict[Any, Any]) -> Iterator[None]:
    """Inside the block, every name bound to a key of ``replacements`` is bound to its value."""
    undo: list[tuple[Any, str, Any]] = []
    for owner in _owners():
        for attr, value in list(vars(owner).items()):
            try:
                replacement = replacements.get(value)
            except TypeError:  # unhashable module attributes
                continue
            if replacement is not None:
                setattr(owner, attr, replacement)
                undo.append((owner, attr, value))
    try:
        yield
    finally:
        for owner, attr, value in reversed(undo):
            setattr(owner, attr, value)
