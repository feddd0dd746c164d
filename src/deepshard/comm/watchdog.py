"""Turn a collective that never completes, or that a vanished peer broke, into an error that says what is
stuck and which rank is missing.

Every rank counts the collectives it waits on through its group's watchdog (the same sequence on every
rank, since every rank issues the same collectives in the same order). When a wait exceeds the timeout
(``DEEPSHARD_WATCHDOG_TIMEOUT`` seconds, default 300; 0 switches the watchdog off) or fails because a
peer closed its connection (gloo closes a timed-out rank's connections, so its peers see "Connection
closed by peer" first), the rank publishes its position in the process group's key-value store, gives the
others a grace period to do the same (they are usually stuck or failing too), and raises
:class:`CollectiveTimeout` naming the collective and the ranks that reported a different position or
reported nothing. Every rank that sees the failure composes the same kind of diagnosis, so whichever
rank the launcher reports first, its message carries it.
"""
from __future__ import annotations

import datetime
import os
import re
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepshard.comm.group import CommGroup

DEFAULT_TIMEOUT_S = 300.0
GRACE_S = 5.0
_KEY = "deepshard/watchdog/last/"
_PEER_GONE = ("connection closed", "connection reset", "broken pipe", "connection refused",
              "socket closed", "end of file", "connection abort")
_MISMATCH = ("size doesn't match", "size does not match", "mismatch", "doesn't match expected")


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time, or a peer vanished during it (a hang turned into an error)."""


def timeout_from_env(timeout_s: float | None = None) -> float:
    """The watchdog timeout: ``timeout_s``, else ``DEEPSHARD_WATCHDOG_TIMEOUT``, else 300 s."""
    if timeout_s is not None:
        return float(timeout_s)
    env = os.environ.get("DEEPSHARD_WATCHDOG_TIMEOUT", "").strip()
    if not env:
        return DEFAULT_TIMEOUT_S
    try:
        return float(env)
    except ValueError:
        raise ValueError(f"DEEPSHARD_WATCHDOG_TIMEOUT={env!r} is not a number of seconds; set it to e.g. "
                         "300 (0 switches the collective watchdog off)") from None


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


class Watchdog:
    """``wait(work, what)`` with a timeout and a diagnosis; ``sequence`` counts the collectives waited on
    (in the order every rank issues them)."""

    def __init__(self, comm: "CommGroup", timeout_s: float | None = None) -> None:
        self.comm = comm
        self.timeout_s = timeout_from_env(timeout_s)
        self.sequence = 0
        self._store = _default_store()

    def wait(self, work: Any, what: str) -> None:
        self.sequence += 1
        if self.comm.size == 1 or self.timeout_s <= 0:
            work.wait()
            return
        try:
            done = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            kind = failure_kind(err)
            if kind is None:
                raise
            if kind in ("peer", "mismatch"):
                raise CollectiveTimeout(self.diagnose(what, peer_error=str(err), kind=kind)) from err
            done = False
        if done is False:
            raise CollectiveTimeout(self.diagnose(what))

    def diagnose(self, what: str, peer_error: str | None = None, kind: str = "timeout") -> str:
        """Publish this rank's position, collect the others' for a grace period, and say who is missing."""
        me, seq = self.comm.rank, self.sequence
        if peer_error is None:
            head = f"did not complete within {self.timeout_s:.0f}s."
        elif kind == "mismatch":
            first = _first_line(peer_error, "size mismatch")
            head = (f"failed: another rank sent data of a different size ({first}): the ranks issued "
                    "different collectives at this point.")
        else:
            first = _first_line(peer_error, "connection lost")
            head = (f"failed: another rank closed its connection ({first}): it raised an error, "
                    "exited, or its own watchdog gave up on a collective.")
        lines = [f"rank {me}: {what} (collective #{seq} of this rank) {head}"]
        reports = self._exchange_positions(f"{seq}|{what}")
        if reports is None:
            lines.append("No key-value store is reachable to tell which rank is missing.")
            return " ".join(lines)
        missing = [r for r in range(self.comm.size) if r != me and r not in reports]
        if missing:
            lines.append(f"Rank(s) {missing} did not arrive: they issued no matching collective and report "
                         "nothing (still computing, stuck outside the library's collectives, or dead).")
        for r, v in sorted(reports.items()):
            if v != f"{seq}|{what}":
                other_seq, other_what = v.split("|", 1)
                lines.append(f"Rank {r} is waiting in a different collective: #{other_seq}, {other_what}.")
        lines.append("Every rank must issue the same collectives in the same order: no rank-dependent "
                     "branches around forward/backward/step/save_checkpoint; gather parameters used outside "
                     "forward with deepshard.zero.GatheredParameters on every rank.")
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
