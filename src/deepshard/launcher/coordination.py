"""The node agents' job channel, kept in the store of their rendezvous (see :mod:`.rendezvous`)."""
from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0
STORE_OP_TIMEOUT_S = 10.0


class ChannelLost(RuntimeError):
    """The coordination store cannot be reached (node 0's agent died or the network is down)."""


class JobConfigMismatch(RuntimeError):
    """This node's command line describes another job than node 0's."""


@dataclass(frozen=True)
class JobFailure:
    """Why a job attempt ended: a rank died (``kind='rank'``), a node stopped answering (``lost``),
    or someone stopped the job (``abort``: a signal, the launcher going away)."""

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


def _key(round_: int, name: str) -> str:
    return f"round{round_}/{name}"


class JoinTimeout(TimeoutError):
    """Some nodes did not join an attempt in time; ``missing``: their node ranks (they never started it, so
    nobody waits for them to confirm its end)."""

    def __init__(self, missing: list[int], message: str) -> None:
        super().__init__(message)
        self.missing = missing


class JobChannel:
    """One agent's view of the coordination store (``store`` is any c10d ``Store``; tests pass a
    ``HashStore``). ``clock`` is injectable so heartbeat timing can be tested without sleeping."""

    def __init__(self, store: Any, node_rank: int, num_nodes: int, hosts: Sequence[str],
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.node_rank = node_rank
        self.num_nodes = num_nodes
        self.hosts = list(hosts)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._seen: dict[int, tuple[int, float]] = {}

    # ------------------------------------------------------------------------------------ plumbing

    def _call(self, op: Callable[[], Any]) -> Any:
        try:
            return op()
        except RuntimeError as exc:  # torch.distributed.DistError and friends derive from it
            raise ChannelLost(_first_line(exc)) from exc

    def _has(self, key: str) -> bool:
        return bool(self._call(lambda: self.store.check([key])))

    def _get(self, key: str) -> bytes:
        return self._call(lambda: self.store.get(key))

    def _add(self, key: str, amount: int) -> int:
        return int(self._call(lambda: self.store.add(key, amount)))

    # -------------------------------------------------------------------------------- job protocol

    def check_config(self, config: str) -> None:
        """Node 0 publishes ``config``; every other node checks that its own is the same."""
        if self.node_rank == 0:
            self._call(lambda: self.store.set("config", config))
            return
        theirs = self._get("config").decode("utf-8")
        if theirs != config:
            raise JobConfigMismatch(
                f"node {self.node_rank}'s launch does not match node 0's: node 0 runs {theirs}, this node "
                f"{config}; run the same deepshard command (same hostfile, selection, --max_restarts, "
                "script and arguments) on every node, only --node_rank differs")

    def join(self, round_: int, timeout_s: float, poll_s: float = 0.1) -> None:
        """Barrier before attempt ``round_``: ``JoinTimeout`` names the missing nodes, ``ChannelLost`` an abort or
        (on node 0) a node gone silent."""
        self._call(lambda: self.store.set(_key(round_, f"joined/{self.node_rank}"), "1"))
        deadline = self._clock() + timeout_s
        while True:
            missing = [n for n in range(self.num_nodes) if not self._has(_key(round_, f"joined/{n}"))]
            if not missing:
                return
            abort = self.abort()
            if abort is not None:
                raise ChannelLost(f"job aborted while waiting for the nodes: {abort.headline()}")
            lost = self.lost_nodes() if self.node_rank == 0 else []
            if lost:
                failure = self.publish_abort(JobFailure(
                    "lost", lost[0], self.hosts[lost[0]], "the node agent",
                    f"sent no heartbeat for {self.heartbeat_timeout_s:.0f} s while the nodes gathered",
                    1, restartable=False))
                raise ChannelLost(f"job aborted while waiting for the nodes: {failure.headline()}")
            if self._clock() >= deadline:
                names = ", ".join(f"node {n} ({self.hosts[n]})" for n in missing)
                raise JoinTimeout(missing,
                    f"attempt {round_}: {names} did not join within {timeout_s:.0f} s; start the same "
                    "command there (with its --node_rank), check that it can reach "
                    "master_addr:master_port, or raise DEEPSHARD_JOIN_TIMEOUT (seconds)")
            time.sleep(poll_s)

    def publish_failure(self, round_: int, failure: JobFailure) -> JobFailure:
        """Record ``failure`` for attempt ``round_`` unless another node was first; returns the
        failure that stands (the first one)."""
        winner = self._call(lambda: self.store.compare_set(_key(round_, "failure"), "", failure.to_json()))
        return JobFailure.from_json(winner)

    def failure(self, round_: int) -> JobFailure | None:
        key = _key(round_, "failure")
        return JobFailure.from_json(self._get(key)) if self._has(key) else None

    def publish_abort(self, failure: JobFailure) -> JobFailure:
        """End the whole job, no restart; returns the abort that stands (the first one)."""
        winner = self._call(lambda: self.store.compare_set("abort", "", failure.to_json()))
        return JobFailure.from_json(winner)

    def abort(self) -> JobFailure | None:
        return JobFailure.from_json(self._get("abort")) if self._has("abort") else None

    def mark_finished(self, round_: int) -> None:
        self._add(_key(round_, "finished"), 1)

    def all_finished(self, round_: int) -> bool:
        return self._add(_key(round_, "finished"), 0) >= self.num_nodes

    # ---------------------------------------------------------------------------------- liveness

    def beat(self) -> None:
        self._add(f"heartbeat/{self.node_rank}", 1)

    def lost_nodes(self) -> list[int]:
        """Nodes (not 0) whose heartbeat count has not moved for ``heartbeat_timeout_s`` on this agent's clock; a
        node that never beat has not started (the join timeout covers it)."""
        now, lost = self._clock(), []
        for node in range(1, self.num_nodes):
            if node == self.node_rank:
                continue
            count = self._add(f"heartbeat/{node}", 0)
            if count == 0:
                continue
            seen = self._seen.get(node)
            if seen is None or seen[0] != count:
                self._seen[node] = (count, now)
            elif now - seen[1] > self.heartbeat_timeout_s:
                lost.append(node)
        return lost

    def mark_exited(self) -> None:
        self._call(lambda: self.store.set(f"exited/{self.node_rank}", "1"))

    def wait_exited(self, timeout_s: float, skip: Sequence[int] = (), poll_s: float = 0.05) -> list[int]:
        """Node 0: wait until every other node (but ``skip``) marked itself exited; returns those that
        did not within ``timeout_s``."""
        deadline = self._clock() + timeout_s
        while True:
            waiting = [n for n in range(1, self.num_nodes) if n not in skip and not self._has(f"exited/{n}")]
            if not waiting or self._clock() >= deadline:
                return waiting
            time.sleep(poll_s)


# Clients connect in attempts this long, so Ctrl-C is honoured while node 0 is not up yet.
CONNECT_ATTEMPT_S = 2.0


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def open_store(master_addr: str, port: int, is_host: bool, connect_timeout_s: float,
               op_timeout_s: float = STORE_OP_TIMEOUT_S) -> Any:
    """Node 0 serves the store on ``port`` (all interfaces); the others connect to
    ``master_addr:port``, retrying until ``connect_timeout_s``."""
    from torch.distributed import TCPStore

    if is_host:
        try:
            store = TCPStore(master_addr, port, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=op_timeout_s))
        except RuntimeError as exc:
            raise ChannelLost(f"node 0 cannot serve the coordination store on port {port} ({_first_line(exc)}); "
                              "the port must be free: pick another --master_port") from exc
        return store
    deadline = time.monotonic() + connect_timeout_s
    while True:
        attempt = max(0.1, min(CONNECT_ATTEMPT_S, deadline - time.monotonic()))
        try:
            store = TCPStore(master_addr, port, is_master=False, timeout=datetime.timedelta(seconds=attempt))
            break
        except RuntimeError as exc:
            if time.monotonic() >= deadline:
                raise ChannelLost(
                    f"cannot reach node 0's coordination store at {master_addr}:{port} within "
                    f"{connect_timeout_s:.0f} s ({_first_line(exc)}); start node 0 with the same command, "
                    "check --master_addr / --master_port, and that the port is open between the nodes") from exc
    store.set_timeout(datetime.timedelta(seconds=op_timeout_s))
    return store


class Heartbeat:
    """A daemon thread calling ``channel.beat()`` every ``interval_s`` on its own store connection;
    ``lost`` holds the error when the store stops answering."""

    def __init__(self, channel: JobChannel, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self._channel = channel
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.lost: str | None = None
        self._thread = threading.Thread(target=self._run, name="deepshard-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._channel.beat()
            except ChannelLost as exc:
                if not self._stop.is_set():
                    self.lost = str(exc)
                return
            self._stop.wait(self._interval_s)

    def stop(self) -> None:
        self._stop.set()
