"""Failure-collective save phases: every rank runs a phase, then all ranks agree whether it succeeded.

``save_checkpoint`` is a sequence of phases (prepare the staging directory, write each rank's files,
publish). A rank that cannot do its part (disk full, no permission) must not leave the others waiting in
the next barrier, and every rank must learn why: :func:`run_phase` replaces the barrier after each phase
with an agreement (one all-reduce of a failure flag per rank, waited on under the group's watchdog, then
the failing ranks' messages gathered), and raises the same :class:`CheckpointSaveError` on every rank,
naming the failing rank(s) and their errors (for a write: the file, the directory, the bytes needed and
free).
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from deepshard.checkpoint.io import CheckpointError
from deepshard.comm.group import CommGroup
from deepshard.comm.watchdog import CollectiveTimeout

T = TypeVar("T")


class CheckpointSaveError(CheckpointError):
    """``save_checkpoint`` failed on at least one rank; raised with the same message on every rank."""


def run_phase(comm: CommGroup, phase: str, action: Callable[[], T]) -> T | None:
    """Run ``action`` on this rank, then agree with every rank: all succeeded (return ``action``'s value)
    or every rank raises the same :class:`CheckpointSaveError`."""
    error: Exception | None = None
    result: T | None = None
    try:
        result = action()
    except CollectiveTimeout:
        raise  # the others are gone or stuck: there is nobody to agree with
    except Exception as err:  # noqa: BLE001 - reported to every rank below
        error = err
    agree(comm, phase, error)
    return result


def agree(comm: CommGroup, phase: str, error: Exception | None) -> None:
    """Raise the same error on every rank when ``error`` is not None on any rank."""
    failed = _failed_ranks(comm, f"save_checkpoint's barrier after {phase}", error is not None)
    if not failed:
        return
    mine = None if error is None else f"{type(error).__name__}: {error}"
    messages = _gather_messages(comm, mine)
    details = "; ".join(f"rank {r}: {messages[r]}" for r in failed)
    raise CheckpointSaveError(
        f"save_checkpoint failed on rank(s) {failed} while {phase}: {details}. Nothing was published: "
        "the previous checkpoint of this tag (if any) and the 'latest' file are unchanged") from error


def agree_on_load(comm: CommGroup, phase: str, error: Exception | None) -> None:
    """After each rank read its own files of a checkpoint: when any rank failed, every rank raises. A rank
    that failed raises its own error (the type and message it would have alone); the others raise a
    :class:`CheckpointError` naming the failed ranks and their errors (a rank reads only the files it
    loads, so a damaged file is seen by its readers only, and the others must not wait for them)."""
    failed = _failed_ranks(comm, f"load_checkpoint's agreement after {phase}", error is not None)
    if not failed:
        return
    mine = None if error is None else f"{type(error).__name__}: {error}"
    messages = _gather_messages(comm, mine)
    if error is not None:
        raise error
    details = "; ".join(f"rank {r}: {messages[r]}" for r in failed)
    raise CheckpointError(f"load_checkpoint failed on rank(s) {failed} while {phase}: {details}")


def _failed_ranks(comm: CommGroup, what: str, failed_here: bool) -> list[int]:
    """The ranks that failed: one all-reduce of a failure count (the same few bytes at any world size),
    then, only when something failed, the flags of every rank."""
    if comm.size == 1:
        return [0] if failed_here else []
    count = torch.tensor([1.0 if failed_here else 0.0], dtype=torch.float32, device=comm._device())
    comm.all_reduce_control(count, what)
    if count.item() == 0:
        return []
    flags = torch.zeros(comm.size, dtype=torch.float32, device=comm._device())
    flags[comm.rank] = 1.0 if failed_here else 0.0
    comm.all_reduce_control(flags, f"{what} (which ranks failed)")
    return [r for r in range(comm.size) if flags[r].item() > 0]


def _gather_messages(comm: CommGroup, mine: str | None) -> list[str | None]:
    if comm.size == 1:
        return [mine]
    gathered: list[str | None] = [None] * comm.size
    dist.all_gather_object(gathered, mine, group=comm.group)
    return gathered
