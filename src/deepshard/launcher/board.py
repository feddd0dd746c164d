"""The job board of a static multi-node job: a few keys in the store of torch's c10d rendezvous (node 0's
agent serves it on ``master_port``) that say what torch's agents do not tell one another: which rank failed
first in an attempt, that the job was stopped, and whether every node's agent is still alive while its ranks
run (torch's rendezvous checks liveness only while the nodes gather)."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0


class StoreLost(RuntimeError):
    """The rendezvous store stopped answering (node 0's agent died, or the network is down)."""


@dataclass(frozen=True)
class JobFailure:
    """Why a job attempt ended: a rank died (``kind='rank'``), a node stopped answering (``lost``), or someone
    stopped the job (``abort``: a signal, the launcher going away)."""

    kind: str
    node: int
    host: str
    who: str  # e.g. ``rank 3 (local rank 1, pid 4242)`` or ``the node agent``.
    what: str  # e.g. ``exited with code 3`` or ``received SIGINT``.
    exit_code: int
    rank: int | None = None
    tail: str = ""
    restartable: bool = True

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "JobFailure":
        return cls(**json.loads(text))

    def headline(self) -> str:
        """``rank 3 (local rank 1, pid 4242) on host worker-1 (node 1) exited with code 3``."""
        return f"{self.who} on host {self.host} (node {self.node}) {self.what}"


class JobBoard:
    """One node agent's view of the board (``store``: any c10d ``Store``; tests pass a ``HashStore``).
    ``clock`` is injectable so the liveness check can be tested without sleeping."""

    def __init__(self, store: Any, node_rank: int, hosts: Sequence[str],
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.node_rank, self.hosts = store, node_rank, list(hosts)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._seen: dict[int, tuple[int, float]] = {}

    def _call(self, op: Callable[[], Any]) -> Any:
        try:
            return op()
        except RuntimeError as exc:  # torch.distributed.DistError and its kin derive from it
            raise StoreLost(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc

    def _record(self, key: str) -> JobFailure | None:
        found = self._call(lambda: self.store.check([key]))
        return JobFailure.from_json(self._call(lambda: self.store.get(key))) if found else None

    def _first(self, key: str, failure: JobFailure) -> JobFailure:
        return JobFailure.from_json(self._call(lambda: self.store.compare_set(key, "", failure.to_json())))

    # ---------------------------------------------------------------------------- who is in the job

    def register(self, fingerprint: str) -> None:
        """Before the rendezvous: this node is here (its job description, by node rank)."""
        self._call(lambda: self.store.set(f"node/{self.node_rank}", fingerprint))

    def missing(self) -> list[int]:
        """The node ranks that never registered."""
        return [n for n in range(len(self.hosts)) if not self._call(lambda n=n: self.store.check([f"node/{n}"]))]

    def check_job(self) -> str | None:
        """After the rendezvous (every node is in): what is wrong with the nodes' command lines, or None (every
        node sees the same answer, so all of them refuse a mismatched job)."""
        absent = self.missing()
        if absent:
            names = ", ".join(f"node {n} ({self.hosts[n]})" for n in absent)
            return (f"{names} did not register although every node joined: two machines were started with the "
                    "same --node_rank; give each machine its own")
        jobs = [self._call(lambda n=n: self.store.get(f"node/{n}")).decode("utf-8") for n in range(len(self.hosts))]
        odd = next((n for n, job in enumerate(jobs) if job != jobs[0]), None)
        if odd is None:
            return None
        return (f"node {odd}'s launch does not match node 0's: node 0 runs {jobs[0]}, node {odd} {jobs[odd]}; run "
                "the same deepshard command (same hostfile, selection, --max_restarts, script and arguments) on "
                "every node, only --node_rank differs")

    # ------------------------------------------------------------------------------ one attempt

    def publish_failure(self, attempt: int, failure: JobFailure) -> JobFailure:
        """Record ``failure`` for ``attempt`` unless another node was first; returns the one that stands."""
        return self._first(f"attempt{attempt}/failure", failure)

    def failure(self, attempt: int) -> JobFailure | None:
        return self._record(f"attempt{attempt}/failure")

    def publish_abort(self, failure: JobFailure) -> JobFailure:
        """End the whole job, no restart; returns the abort that stands (the first one)."""
        return self._first("abort", failure)

    def abort(self) -> JobFailure | None:
        return self._record("abort")

    def mark_finished(self, attempt: int) -> None:
        self._call(lambda: self.store.add(f"attempt{attempt}/finished", 1))

    def all_finished(self, attempt: int) -> bool:
        return int(self._call(lambda: self.store.add(f"attempt{attempt}/finished", 0))) >= len(self.hosts)

    # ------------------------------------------------------------------------------ liveness

    def beat(self) -> None:
        self._call(lambda: self.store.add(f"alive/{self.node_rank}", 1))

    def lost_nodes(self) -> list[int]:
        """Nodes (not this one) whose heartbeat count has not moved for ``heartbeat_timeout_s`` on this agent's
        clock; a node that never beat is not counted (it has not started its ranks)."""
        now, lost = self._clock(), []
        for node in range(len(self.hosts)):
            if node == self.node_rank:
                continue
            count = int(self._call(lambda node=node: self.store.add(f"alive/{node}", 0)))
            seen = self._seen.get(node)
            if count == 0:
                continue
            if seen is None or seen[0] != count:
                self._seen[node] = (count, now)
            elif now - seen[1] > self.heartbeat_timeout_s:
                lost.append(node)
        return lost

    def mark_exited(self) -> None:
        self._call(lambda: self.store.set(f"exited/{self.node_rank}", "1"))

    def wait_exited(self, timeout_s: float, skip: Sequence[int] = (), poll_s: float = 0.05) -> list[int]:
        """Node 0: wait until every other node that registered (but ``skip``) left; returns those that did not
        in time (a node that never came is not waited for)."""
        deadline = self._clock() + timeout_s
        came = [n for n in range(1, len(self.hosts)) if n not in skip and n not in self.missing()]
        while True:
            waiting = [n for n in came if not self._call(lambda n=n: self.store.check([f"exited/{n}"]))]
            if not waiting or self._clock() >= deadline:
                return waiting
            time.sleep(poll_s)


class Heartbeat:
    """A daemon thread calling ``board.beat()`` every ``interval_s``; ``lost`` holds the error once the store
    stops answering."""

    def __init__(self, board: JobBoard, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self._board, self._interval_s = board, interval_s
        self._stop = threading.Event()
        self.lost: str | None = None
        threading.Thread(target=self._run, name="deepshard-heartbeat", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._board.beat()
            except StoreLost as exc:
                if not self._stop.is_set():
                    self.lost = str(exc)
                return
            self._stop.wait(self._interval_s)

    def stop(self) -> None:
        self._stop.set()
