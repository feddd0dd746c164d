"""Turn a collective or transfer that never completes, or that a vanished peer broke, into an error that
says what is stuck, at which step, and which rank is missing.

One setting bounds every wait: ``DEEPSHARD_TIMEOUT`` (minutes; DeepSpeed's ``DEEPSPEED_TIMEOUT`` is read
too), which is also the process-group timeout ``deepshard.init_distributed`` sets. Without it the
process group's own timeout applies (10 minutes under ``deepshard.init_distributed``).

Every rank counts the collectives it waits on through its group's watchdog (the same sequence on every
rank, since every rank issues the same collectives in the same order) and knows its training step (the
engine's ``global_steps``). When a wait exceeds the timeout, or fails because a peer closed its connection
(a rank that raised, exited, or whose own watchdog gave up), the rank publishes its position (collective
number, step, what it waits on) in the process group's key-value store, gives the others a grace period
to do the same (they are usually stuck or failing too), and raises :class:`CollectiveTimeout` naming its
wait, the timeout that fired and where it came from, and the ranks that reported another position or
reported nothing. Point-to-point transfers (the pipeline's) are waited on the same way, without a
sequence number (the two ends of a transfer issue different operations).

On NCCL the watchdog only counts: a timed wait there holds the host until the GPU is done, so NCCL's own
watchdog (the process group's timeout, the same setting) turns a hang into an error instead.
"""
from __future__ import annotations

import datetime
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from deepshard.comm.settings import timeout_minutes


DEFAULT_TIMEOUT_S = 600.0
GRACE_S = 5.0
_KEY = "deepshard/watchdog/last/"
_PEER_GONE = ("connection closed", "connection reset", "broken pipe", "connection refused",
              "socket closed", "end of file", "connection abort")
_MISMATCH = ("size doesn't match", "size does not match", "mismatch", "doesn't match expected")
_GLOO_WAITED = re.compile(r"timed out waiting (\d+)\s*ms", re.IGNORECASE)


class WatchedGroup(Protocol):
    """What the watchdog reads of the group it guards (a ``CommGroup``)."""

    group: Any
    rank: int
    size: int
    peers: list[int]
    backend: str
    progress: Any
    """Whatever counts the training steps (``global_steps``): the owning engine's state, or None."""


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time, or a peer vanished during it (a hang turned into an error)."""


@dataclass(frozen=True)
class WaitLimit:
    """How long a wait may last, and the setting it comes from (quoted in every timeout message)."""

    seconds: float
    source: str


def wait_limit(group: Any = None, environ: Mapping[str, str] | None = None) -> WaitLimit:
    """The timeout of every wait on ``group`` (None = the default group): ``DEEPSHARD_TIMEOUT`` when set,
    else the process group's own timeout, else 10 minutes."""
    found = timeout_minutes(os.environ if environ is None else environ)
    if found is not None:
        key, minutes = found
        return WaitLimit(minutes * 60.0, f"{key}={minutes:g} minutes")
    seconds = _process_group_timeout(group)
    if seconds is not None:
        return WaitLimit(seconds, "the process group's timeout; set DEEPSHARD_TIMEOUT (minutes) to change it")
    return WaitLimit(DEFAULT_TIMEOUT_S, "the default; set DEEPSHARD_TIMEOUT (minutes) to change it")


def _process_group_timeout(group: Any) -> float | None:
    try:
        import torch
        import torch.distributed as dist

        pg = group if group is not None else dist.group.WORLD
        return float(pg._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    except Exception:  # noqa: BLE001 - private API, absent on some backends: the default applies
        return None


def failure_kind(err: BaseException) -> str | None:
    """"timeout", "peer" (a lost peer connection) or "mismatch" (the ranks issued different collectives:
    the backend saw a message of another size) when ``err`` is a collective's failure, else None."""
    text = str(err).lower()
    if "timed out" in text or "timeout" in text:
        return "timeout"
    if any(mark in text for mark in _PEER_GONE):
        return "peer"
    if any(mark in text for mark in _MISMATCH):
        return "mismatch"
    return None


_COLLECTIVE_ADVICE = ("Every rank must issue the same collectives in the same order: no rank-dependent branches "
                      "around forward/backward/step/save_checkpoint; gather parameters used outside forward with "
                      "deepshard.zero.GatheredParameters on every rank.")
_TRANSFER_ADVICE = ("Every pipeline stage must run the same batches: the same gradient_accumulation_steps, as many "
                    "train_batch/eval_batch calls, and data iterators on the first and last stages that do not run "
                    "short.")


class Watchdog:
    """``wait(work, what)`` with the timeout of :func:`wait_limit` and a diagnosis; ``sequence`` counts the
    collectives waited on (in the order every rank issues them)."""

    def __init__(self, comm: WatchedGroup, limit: WaitLimit | None = None) -> None:
        self.comm = comm
        self.limit = limit if limit is not None else wait_limit(comm.group)
        self.sequence = 0
        self._store = _default_store()

    @property
    def timeout_s(self) -> float:
        return self.limit.seconds

    def step(self) -> int | None:
        """The training step of the engine that owns this group (None outside an engine)."""
        steps = getattr(getattr(self.comm, "progress", None), "global_steps", None)
        return steps if isinstance(steps, int) else None

    def wait(self, work: Any, what: str, transfer: bool = False) -> None:
        """Wait for ``work``; a timeout or a lost peer raises :class:`CollectiveTimeout`. ``transfer``: a
        point-to-point transfer (not counted in the collective sequence)."""
        if not transfer:
            self.sequence += 1
        if self.comm.backend == "nccl" or (not transfer and self.comm.size == 1):
            # NCCL: a plain wait orders the current stream after the collective and returns at once; a
            # timed one would hold the host until the device finished (polling every millisecond), so the
            # host could no longer queue work ahead of the GPU. NCCL's own watchdog bounds the wait with
            # the process group's timeout, which DEEPSHARD_TIMEOUT sets (deepshard.distributed).
            work.wait()
            return
        try:
            done = work.wait(timeout=datetime.timedelta(seconds=self.limit.seconds))
        except RuntimeError as err:
            kind = failure_kind(err)
            if kind is None:
                raise
            raise CollectiveTimeout(self.diagnose(what, peer_error=str(err), kind=kind, transfer=transfer)) from err
        if done is False:
            raise CollectiveTimeout(self.diagnose(what, transfer=transfer))

    def _head(self, peer_error: str | None, kind: str) -> str:
        if kind == "timeout":
            seconds, source = self.limit.seconds, self.limit.source
            fired = _GLOO_WAITED.search(peer_error or "")
            if fired is not None and abs(int(fired.group(1)) / 1000.0 - seconds) >= 1.0:
                seconds = int(fired.group(1)) / 1000.0
                source = "the process group's timeout, given when it was created; DEEPSHARD_TIMEOUT sets it " \
                         "when deepshard creates the process group"
            return f"did not complete within {seconds:g}s ({source})."
        if kind == "mismatch":
            first = _first_line(peer_error or "", "size mismatch")
            return (f"failed: another rank sent data of a different size ({first}): the ranks issued "
                    "different collectives at this point.")
        first = _first_line(peer_error or "", "connection lost")
        return (f"failed: another rank closed its connection ({first}): it raised an error, exited, or its "
                "own watchdog gave up.")

    def diagnose(self, what: str, peer_error: str | None = None, kind: str = "timeout",
                 transfer: bool = False) -> str:
        """Publish this rank's position, collect the others' for a grace period, and say who is missing."""
        me, step = self.comm.rank, self.step()
        seq = "-" if transfer else str(self.sequence)
        at = "" if step is None else f"step {step}"
        where = f"({at})" if transfer else f"(collective #{seq} of this rank{', ' + at if at else ''})"
        lines = [f"rank {self.comm.peers[me] if me < len(self.comm.peers) else me}: {what} {where} "
                 f"{self._head(peer_error, kind)}"]
        mine = f"{seq}|{'' if step is None else step}|{what}"
        reports = self._exchange_positions(mine)
        if reports is None:
            lines.append("No key-value store is reachable to tell which rank is missing.")
            return " ".join(lines)
        missing = [self.comm.peers[r] for r in range(self.comm.size) if r != me and r not in reports]
        if missing:
            lines.append(f"Rank(s) {missing} did not arrive: they issued no matching operation and report "
                         "nothing (still computing, stuck outside the library's waits, exited, or dead).")
        for r, v in sorted(reports.items()):
            if v != mine:
                lines.append(_describe_position(self.comm.peers[r], v))
        lines.append(_TRANSFER_ADVICE if transfer else _COLLECTIVE_ADVICE)
        return " ".join(lines)

    def _exchange_positions(self, mine: str) -> dict[int, str] | None:
        """The other ranks' published positions (group ranks), or None without a reachable store."""
        if self._store is None:
            return None
        me = self.comm.rank
        try:
            self._store.set(self._key(me), mine)
            deadline = time.monotonic() + GRACE_S
            reports: dict[int, str] = {}
            while time.monotonic() < deadline and len(reports) < self.comm.size - 1:
                for r in range(self.comm.size):
                    key = self._key(r)
                    if r != me and r not in reports and self._store.check([key]):
                        reports[r] = self._store.get(key).decode()
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 - the store's host (rank 0) may be gone: say so, don't mask
            return None
        return reports

    def _key(self, group_rank: int) -> str:
        """Where a rank of this group publishes its position (the group's members name the group)."""
        members = ",".join(map(str, self.comm.peers))
        return f"{_KEY}{members}/{self.comm.peers[group_rank] if group_rank < len(self.comm.peers) else group_rank}"


def _describe_position(rank: int, report: str) -> str:
    """A published position (``seq|step|what``) in words."""
    seq, step, what = (report.split("|", 2) + ["", ""])[:3]
    at = f" at step {step}" if step else ""
    if seq == "-":
        return f"Rank {rank} is waiting in a transfer{at}: {what}."
    return f"Rank {rank} is waiting in a different collective: #{seq}{at}, {what}."


def _first_line(error: str, default: str) -> str:
    """The backend's message without its source location (``[.../pair.cc:553] Connection closed ...``)."""
    text = error.strip().splitlines()[0] if error.strip() else default
    return re.sub(r"^\[[^\]]*\]\s*", "", text)[:160]


def _default_store() -> Any:
    try:
        import torch.distributed.distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: the diagnosis says so
        return None
