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

import hashlib
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from deepshard.checkpoint.io import CheckpointError
from deepshard.comm.group import CommGroup
from deepshard.comm.watchdog import CollectiveTimeout
from deepshard.utils.logging import logger

T = TypeVar("T")


class CheckpointSaveError(CheckpointError):
    """``save_checkpoint`` failed on at least one rank; raised with the same message on every rank."""


class CheckpointTagMismatch(CheckpointError, AssertionError):
    """The ranks passed different tags to ``save_checkpoint`` under ``"checkpoint": {"tag_validation": "Fail"}``.
    Also an ``AssertionError``: what DeepSpeed raises there, so code catching DeepSpeed's error catches it."""


def agree_on_tag(comm: CommGroup, tag: str, mode: str) -> str:
    """The tag every rank saves under: this rank's when all ranks passed the same one. Otherwise rank 0's
    (one checkpoint directory, whole, instead of a share of one under each rank's tag), after a warning
    (``tag_validation`` "Warn", the default) or silently ("Ignore"); under "Fail" every rank raises
    :class:`CheckpointTagMismatch`. Every rank must call it (one small all-gather)."""
    if comm.size == 1:
        return tag
    if _same_everywhere(comm, tag):
        return tag
    tags: list[str | None] = [None] * comm.size
    dist.all_gather_object(tags, tag, group=comm.group)  # every rank is here: the check above met them all
    by_rank = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
    problem = (f"save_checkpoint was called with different tags on different ranks ({by_rank}); a checkpoint "
               "is one directory written by every rank, so pass every rank the same tag (leave rank-unique "
               "information, such as the rank, out of it)")
    if mode == "Fail":
        raise CheckpointTagMismatch(problem + ' ("checkpoint": {"tag_validation": "Fail"})')
    if mode != "Ignore":
        logger.warning("%s; saving under rank 0's tag %r", problem, tags[0])
    return str(tags[0])


def _same_everywhere(comm: CommGroup, tag: str) -> bool:
    """Whether every rank passed ``tag``: two 24-bit digests of it (exact in float32) and their negations
    reduced by max, so max == -max(-d) on every digest means one value. A control all-reduce, under the
    watchdog: a rank that calls ``save_checkpoint`` while another trains on gets a ``CollectiveTimeout``
    naming both positions, not gloo's abort on the size mismatch an object all-gather would meet."""
    digest = hashlib.sha256(tag.encode("utf-8")).digest()
    values = [float(int.from_bytes(digest[i:i + 3], "big")) for i in (0, 3)]
    both = torch.tensor([v for value in values for v in (value, -value)], dtype=torch.float32,
                        device=comm._device())
    comm.all_reduce_control(both, "save_checkpoint's barrier before writing (the ranks' tags compared)", op="max")
    return bool(both[0].item() == -both[1].item() and both[2].item() == -both[3].item())


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
