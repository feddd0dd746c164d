"""The job board of a static multi-node job: a few keys in the store of torch's c10d rendezvous (node 0's agent
serves it on ``master_port``) that say what torch's agents do not tell one another: which rank failed first in an
attempt (with its last output), that the job was stopped, and whether every node's agent is still alive while its
ranks run (torch's rendezvous checks liveness only while the nodes gather, and offers no public way to ask it
later: so each agent counts a heartbeat here). Each agent publishes and sees failures there, names a silent node,
stops the job on a signal or when the ssh launcher goes away, and prints the job's report."""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from deepshard.launcher.output import exit_status
from deepshard.launcher.rank_streams import RankStream
from deepshard.launcher.report import failure_text

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0
EXIT_WAIT_S = 15.0
CHECK_INTERVAL_S = 0.25
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "closed its connection", "broken pipe")


class StoreLost(RuntimeError):
    """The rendezvous store stopped answering (node 0's agent died, or the network is down)."""


@dataclass(frozen=True)
class JobFailure:
    """Why a job attempt ended: a rank died (``kind='rank'``), a node stopped answering (``lost``), or someone
    stopped the job (``abort``: a signal, the launcher going away). ``who``: e.g. ``rank 3 (local rank 1, pid
    4242)`` or ``the node agent``; ``what``: e.g. ``exited with code 3`` or ``received SIGINT``."""

    kind: str
    node: int
    host: str
    who: str
    what: str
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


def format_job_failure(failure: JobFailure, full: bool) -> str:
    """The report: the headline, and with ``full`` the end of the failed rank's output."""
    return failure_text(f"deepshard: {failure.headline()}", f"rank {failure.rank} (host {failure.host})", failure.rank,
                        failure.tail, full=full and failure.kind == "rank")


def _watch_stdin() -> threading.Event:
    """The ssh launcher holds the agent's stdin open: the event is set at end-of-file (the launcher went away)."""
    closed = threading.Event()

    def run() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        closed.set()

    threading.Thread(target=run, name="deepshard-stdin", daemon=True).start()
    return closed


class JobBoard:
    """One node agent's use of the board (``store``: any c10d ``Store``; tests pass a ``HashStore``, and a ``clock``
    to test the liveness check without sleeping). ``stdin_close``: stop the job when the ssh launcher goes away;
    ``report_on_node0``: every node's output reaches one terminal (see :meth:`report`)."""

    def __init__(self, store: Any, node_rank: int, hosts: Sequence[str],
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, stdin_close: bool = False,
                 report_on_node0: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.node_rank, self.hosts, self._clock = store, node_rank, list(hosts), clock
        self.heartbeat_timeout_s, self.report_on_node0 = heartbeat_timeout_s, report_on_node0
        self.stdin_closed = _watch_stdin() if stdin_close else None
        self.stopped = threading.Event()  # set: the heartbeat ends
        self.heartbeat_lost: str | None = None  # the store's error, once it stopped answering a heartbeat
        self.lost: list[int] = []
        self.seen: JobFailure | None = None
        self.mine: JobFailure | None = None  # this node's own rank failure, until reported
        self._beats: dict[int, tuple[int, float]] = {}
        self._next_check = 0.0

    @property
    def host(self) -> str:
        return self.hosts[self.node_rank]

    def _call(self, op: str, *args: Any) -> Any:
        """``store.op(*args)``; the store's errors (``DistError`` and its kin are ``RuntimeError``) as ``StoreLost``."""
        try:
            return getattr(self.store, op)(*args)
        except RuntimeError as exc:
            raise StoreLost(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc

    def _record(self, key: str) -> JobFailure | None:
        return JobFailure.from_json(self._call("get", key)) if self._call("check", [key]) else None

    def _first(self, key: str, failure: JobFailure) -> JobFailure:
        return JobFailure.from_json(self._call("compare_set", key, "", failure.to_json()))

    def register(self, fingerprint: str) -> None:
        """Before the rendezvous: this node is here (its job description, by node rank)."""
        self._call("set", f"node/{self.node_rank}", fingerprint)

    def missing(self) -> list[int]:
        return [n for n in range(len(self.hosts)) if not self._call("check", [f"node/{n}"])]

    def check_job(self) -> str | None:
        """After the rendezvous (every node is in): what is wrong with the nodes' command lines, or None (every
        node sees the same answer, so all of them refuse a mismatched job)."""
        absent = self.missing()
        if absent:
            names = ", ".join(f"node {n} ({self.hosts[n]})" for n in absent)
            return (f"{names} did not register although every node joined: two machines were started with the "
                    "same --node_rank; give each machine its own")
        jobs = [self._call("get", f"node/{n}").decode("utf-8") for n in range(len(self.hosts))]
        odd = next((n for n, job in enumerate(jobs) if job != jobs[0]), None)
        if odd is None:
            return None
        return (f"node {odd}'s launch does not match node 0's: node 0 runs {jobs[0]}, node {odd} {jobs[odd]}; run "
                "the same deepshard command (same hostfile, selection, --max_restarts, script and arguments) on "
                "every node, only --node_rank differs")

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
        self._call("add", f"attempt{attempt}/finished", 1)

    def all_finished(self, attempt: int) -> bool:
        return int(self._call("add", f"attempt{attempt}/finished", 0)) >= len(self.hosts)

    def beat(self) -> None:
        self._call("add", f"alive/{self.node_rank}", 1)

    def start_heartbeat(self) -> None:
        """Every node but 0 counts a heartbeat every :data:`HEARTBEAT_INTERVAL_S` (node 0 watches them)."""
        if self.node_rank != 0:
            threading.Thread(target=self._beat, name="deepshard-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while not self.stopped.is_set():
            try:
                self.beat()
            except StoreLost as exc:
                self.heartbeat_lost = None if self.stopped.is_set() else str(exc)
                return
            self.stopped.wait(HEARTBEAT_INTERVAL_S)

    def lost_nodes(self) -> list[int]:
        """Nodes (not this one) whose heartbeat count has not moved for ``heartbeat_timeout_s`` on this agent's
        clock; a node that never beat is not counted (it has not started yet)."""
        now, lost = self._clock(), []
        for node in range(len(self.hosts)):
            count = 0 if node == self.node_rank else int(self._call("add", f"alive/{node}", 0))
            seen = self._beats.get(node)
            if count == 0:
                continue
            if seen is None or seen[0] != count:
                self._beats[node] = (count, now)
            elif now - seen[1] > self.heartbeat_timeout_s:
                lost.append(node)
        return lost

    def mark_exited(self) -> None:
        self._call("set", f"exited/{self.node_rank}", "1")

    def wait_exited(self, timeout_s: float, skip: Sequence[int] = (), poll_s: float = 0.05) -> list[int]:
        """Node 0: wait until every other node that registered (but ``skip``) left; returns those that did not
        in time (a node that never came is not waited for)."""
        deadline = self._clock() + timeout_s
        came = [n for n in range(1, len(self.hosts)) if n not in skip and n not in self.missing()]
        while True:
            waiting = [n for n in came if not self._call("check", [f"exited/{n}"])]
            if not waiting or self._clock() >= deadline:
                return waiting
            time.sleep(poll_s)

    def new_attempt(self) -> None:
        """What an ended attempt saw does not stop the next one."""
        self.seen, self.mine = None, None

    def store_lost(self, detail: str) -> JobFailure:
        return JobFailure("lost", 0, self.hosts[0], "the rendezvous store (node 0's agent)",
                          f"stopped answering: {detail}", 1, restartable=False)

    def _abort_with(self, failure: JobFailure) -> JobFailure:
        try:
            return self.publish_abort(failure)
        except StoreLost:
            return failure

    def _lost_node(self, node: int, extra: str = "") -> JobFailure:
        return self._abort_with(JobFailure(
            "lost", node, self.hosts[node], "the node agent",
            f"sent no heartbeat for {self.heartbeat_timeout_s:.0f} s (killed, or its machine is unreachable)"
            + extra, 1, restartable=False))

    def check(self, attempt: int, force: bool = False) -> JobFailure | None:
        """Anything elsewhere in the job that must stop this node's ranks now (None: carry on)."""
        now = time.monotonic()
        if self.seen is not None or not (force or now >= self._next_check):
            return self.seen
        self._next_check = now + CHECK_INTERVAL_S
        if self.stdin_closed is not None and self.stdin_closed.is_set():
            self.seen = self._abort_with(JobFailure("abort", self.node_rank, self.host, "the launcher's ssh "
                                                    "connection", "closed (launcher stopped)", 1, restartable=False))
        elif self.heartbeat_lost is not None:
            self.seen = self.store_lost(self.heartbeat_lost)
        else:
            try:
                self.seen = self.abort() or self.failure(attempt)
                if self.seen is None and self.node_rank == 0:
                    self.lost = self.lost_nodes()
                    self.seen = self._lost_node(self.lost[0]) if self.lost else None
            except StoreLost as exc:
                self.seen = self.store_lost(str(exc))
        return self.seen

    def publish_rank_failure(self, attempt: int, stream: RankStream) -> JobFailure:
        """A rank of this node failed: publish it (the attempt's first failure wins); returns the one that stands."""
        mine = JobFailure("rank", self.node_rank, self.host, stream.who, f"exited with {stream.exit}",
                          exit_status(stream.returncode), rank=stream.rank, tail=stream.text())
        try:
            self.seen, self.mine = self.publish_failure(attempt, mine), mine
        except StoreLost as exc:
            self.seen = self.store_lost(str(exc))
        return self.seen

    def blame(self, failure: JobFailure) -> JobFailure:
        """Node 0: a rank that only lost its connection to a node that vanished is not the cause; that node is."""
        if self.node_rank != 0 or failure.kind != "rank" or not any(m in failure.tail.lower() for m in _PEER_GONE):
            return failure
        deadline = time.monotonic() + self.heartbeat_timeout_s + 2 * CHECK_INTERVAL_S + 1.0
        try:
            while time.monotonic() < deadline:
                self.lost = self.lost_nodes()
                if self.lost:
                    return self._lost_node(self.lost[0], f"; {failure.who} on host {failure.host} then lost its "
                                                         "connection to that node's ranks")
                time.sleep(0.2)
        except StoreLost:
            pass
        return failure

    def stop_job(self, what: str, code: int) -> None:
        """This agent was signalled: stop the other nodes too."""
        self._abort_with(JobFailure("abort", self.node_rank, self.host, "the node agent", what, code,
                                    restartable=False))

    def report(self, failure: JobFailure, local_ranks: int, ending: str) -> None:
        """Node 0 prints the job's failure with the rank's output; the failing node its own (unless all nodes share
        one terminal), another node the job's (the same unless node 0 was lost); every node says what it does next
        (``ending``)."""
        mine, self.mine = self.mine, None
        own = mine is not None and failure.kind == "rank" and failure.node == self.node_rank
        lead = self.node_rank == 0
        if not lead and mine is not None and not self.report_on_node0:
            print(format_job_failure(mine, full=True), file=sys.stderr, flush=True)
        if lead or (not own and (not self.report_on_node0 or (failure.kind == "lost" and failure.node == 0))):
            print(format_job_failure(failure, full=lead), file=sys.stderr, flush=True)
        print(f"deepshard: node {self.node_rank} ({self.host}) stopped its {local_ranks} rank(s) on {len(self.hosts)} "
              f"nodes; {ending}", file=sys.stderr, flush=True)

    def await_others(self, attempt: int) -> JobFailure | None:
        """This node's ranks all succeeded: wait until every node's did (None), or a failure elsewhere ends the
        job (a node whose ranks are done takes no part in a restart)."""
        try:
            self.mark_finished(attempt)
            while not self.all_finished(attempt):
                found = self.check(attempt, force=True)
                if found is not None:
                    return found
                time.sleep(0.1)
        except StoreLost as exc:
            return self.store_lost(str(exc))
        return None

    def close(self) -> None:
        """End of the job: node 0 waits (briefly) for the others to leave before its store goes away."""
        self.stopped.set()
        try:
            if self.node_rank == 0:
                self.wait_exited(EXIT_WAIT_S, skip=self.lost)
            else:
                self.mark_exited()
        except StoreLost:
            pass
