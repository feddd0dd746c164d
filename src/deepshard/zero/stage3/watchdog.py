"""Turn a ZeRO-3 collective that never completes into an error that says what is stuck and who is missing.

Every rank counts the parameter collectives it issues. When a wait exceeds the timeout
(``DEEPSHARD_WATCHDOG_TIMEOUT`` seconds, default 300), the rank publishes its count and what it waits
for in the process group's key-value store, gives the others a grace period to do the same (they are
usually stuck too), and raises an error naming the collective, the module, and the ranks that either
reported a different position or reported nothing (the ranks that did not arrive).
"""
from __future__ import annotations

import datetime
import os
import time
from typing import Any

from deepshard.comm.group import CommGroup

DEFAULT_TIMEOUT_S = 300.0
GRACE_S = 5.0


class CollectiveTimeout(RuntimeError):
    """A ZeRO-3 collective did not complete in time (a hang turned into an error)."""


class Watchdog:
    """``wait(work, what)`` with a timeout and a diagnosis; ``sequence`` counts the collectives waited on
    (in the order every rank issues them)."""

    def __init__(self, comm: CommGroup, timeout_s: float | None = None) -> None:
        self.comm = comm
        env = os.environ.get("DEEPSHARD_WATCHDOG_TIMEOUT")
        self.timeout_s = float(timeout_s if timeout_s is not None else env if env else DEFAULT_TIMEOUT_S)
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
            if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
                raise
            done = False
        if done is False:
            raise CollectiveTimeout(self._diagnose(what))

    def _diagnose(self, what: str) -> str:
        me, seq = self.comm.rank, self.sequence
        lines = [f"rank {me}: {what} (collective #{seq} of this rank) did not complete within "
                 f"{self.timeout_s:.0f}s."]
        if self._store is None:
            lines.append("No key-value store is available to tell which rank is missing.")
            return " ".join(lines)
        self._store.set(f"deepshard/watchdog/last/{me}", f"{seq}|{what}")
        deadline = time.monotonic() + GRACE_S
        reports: dict[int, str] = {}
        while time.monotonic() < deadline and len(reports) < self.comm.size - 1:
            for r in range(self.comm.size):
                if r != me and r not in reports and self._store.check([f"deepshard/watchdog/last/{r}"]):
                    reports[r] = self._store.get(f"deepshard/watchdog/last/{r}").decode()
            time.sleep(0.1)
        missing = [r for r in range(self.comm.size) if r != me and r not in reports]
        elsewhere = {r: v for r, v in reports.items() if v != f"{seq}|{what}"}
        if missing:
            lines.append(f"Rank(s) {missing} did not arrive: they issued no matching collective and report "
                         "nothing (still computing, stuck outside ZeRO-3, or dead).")
        for r, v in sorted(elsewhere.items()):
            other_seq, other_what = v.split("|", 1)
            lines.append(f"Rank {r} is waiting in a different collective: #{other_seq}, {other_what}.")
        lines.append("Every rank must run the same modules in the same order (no rank-dependent branches "
                     "around ZeRO-3 modules); gather parameters used outside forward with "
                     "deepshard.zero.GatheredParameters on every rank.")
        return " ".join(lines)


def _default_store() -> Any:
    try:
        import torch.distributed.distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: the diagnosis says so
        return None
