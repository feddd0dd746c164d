"""The node agents' rendezvous: torch's ``RendezvousHandler`` with static node ranks and a job channel."""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from torch.distributed import PrefixStore
from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

from deepshard.launcher.coordination import (
    HEARTBEAT_TIMEOUT_S,
    ChannelLost,
    Heartbeat,
    JobChannel,
    JobFailure,
    JoinTimeout,
    open_store,
)
from deepshard.launcher.options import LaunchError
from deepshard.launcher.output import exit_status, output_block
from deepshard.launcher.rank_streams import RankStream

JOIN_TIMEOUT_S = 300.0
EXIT_WAIT_S = 15.0
WATCH_INTERVAL_S = 0.25
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "closed its connection", "broken pipe")


def env_seconds(environ: Mapping[str, str], key: str, default: float) -> float:
    value = environ.get(key)
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise LaunchError(f"{key}={value!r} is not a number of seconds; e.g. {key}={default:.0f}") from None


class _StdinWatch:
    """The ssh launcher holds the agent's stdin open; end-of-file means it went away."""

    def __init__(self) -> None:
        self.closed = threading.Event()
        threading.Thread(target=self._run, name="deepshard-stdin", daemon=True).start()

    def _run(self) -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        self.closed.set()


def format_job_failure(failure: JobFailure, full: bool) -> str:
    """The report: the headline, and with ``full`` the end of the failed rank's output."""
    lines = [f"deepshard: {failure.headline()}"]
    if full and failure.kind == "rank":
        lines += output_block(f"rank {failure.rank} (host {failure.host})", failure.rank, failure.tail)
    return "\n".join(lines)


class NodeRendezvous(StaticTCPRendezvous):
    """torch's static rendezvous of ``hosts`` (node ranks = their order), with a job channel in its store:
    join barrier, first failure, heartbeats, aborts (docs/launcher.md, "Under the hood")."""

    def __init__(self, hosts: list[str], node_rank: int, master_addr: str, master_port: int, run_id: str,
                 fingerprint: str, environ: Mapping[str, str], stdin_close: bool = False,
                 local_ranks: int = 1) -> None:
        self.join_timeout_s = env_seconds(environ, "DEEPSHARD_JOIN_TIMEOUT", JOIN_TIMEOUT_S)
        super().__init__(master_addr, master_port, node_rank, len(hosts), run_id, int(self.join_timeout_s))
        self.hosts, self.node_rank, self.fingerprint = hosts, node_rank, fingerprint
        self.heartbeat_timeout_s = env_seconds(environ, "DEEPSHARD_HEARTBEAT_TIMEOUT", HEARTBEAT_TIMEOUT_S)
        self.local_ranks = local_ranks
        self.stdin = _StdinWatch() if stdin_close else None
        self.round = -1
        self.channel: JobChannel | None = None  # type: ignore[assignment]
        self._heartbeat: Heartbeat | None = None
        self.lost: list[int] = []
        self._next_check = 0.0
        self._seen: JobFailure | None = None
        self._round_stores: list[Any] = []
        self.mine: JobFailure | None = None  # this node's own rank failure, until reported

    # -------------------------------------------------------------------------- torch's protocol

    @property
    def multi_node(self) -> bool:
        return len(self.hosts) > 1

    @property
    def host(self) -> str:
        return self.hosts[self.node_rank]

    @property
    def where(self) -> str:
        return f"node {self.node_rank} ({self.host}): " if self.multi_node else ""

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            self._open()
        self.round += 1
        self._seen = None
        if self.multi_node:
            try:
                self.channel.join(self.round, self.join_timeout_s)
            except JoinTimeout as exc:
                self.lost = sorted(set(self.lost) | set(exc.missing))
                raise
        return RendezvousInfo(PrefixStore(f"{self.run_id}/{self.round}", self._store), self.node_rank,
                              len(self.hosts), RendezvousStoreInfo(self.master_addr, self._ranks_port()))

    def _ranks_port(self) -> int:
        """Where this attempt's ranks meet: the agents' store on ``master_port`` for the first attempt; a fresh
        store of node 0 on a free port for each restart (torch's ranks keep no attempt prefix: the keys of the
        ranks that died must not be found by their successors)."""
        if self.round == 0:
            return self.master_port
        key = f"round{self.round}/ranks_port"
        if self.node_rank == 0:
            from torch.distributed import TCPStore

            server = TCPStore(self.master_addr, 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=self.join_timeout_s))
            self._round_stores = [server]  # the previous attempt's store goes; this one lives
            self.channel.store.set(key, str(server.port))
            return int(server.port)
        return int(self.channel.store.get(key))

    def _open(self) -> None:
        is_host = self.node_rank == 0
        timeout = self.join_timeout_s if self.multi_node else 10.0
        self._store = open_store(self.master_addr, self.master_port, is_host, timeout)
        self.channel = JobChannel(PrefixStore("deepshard", self._store), self.node_rank, len(self.hosts),
                                  self.hosts, heartbeat_timeout_s=self.heartbeat_timeout_s)
        if not self.multi_node:
            return
        self.channel.check_config(self.fingerprint)
        if not is_host:
            beat_store = open_store(self.master_addr, self.master_port, False, self.join_timeout_s)
            self._heartbeat = Heartbeat(JobChannel(PrefixStore("deepshard", beat_store), self.node_rank,
                                                   len(self.hosts), self.hosts)).start()

    # -------------------------------------------------------------------------- the job channel

    def store_lost(self, detail: str) -> JobFailure:
        return JobFailure("lost", 0, self.hosts[0], "the coordination store (node 0's agent)",
                          f"stopped answering: {detail}", 1, restartable=False)

    def _abort_with(self, failure: JobFailure) -> JobFailure:
        try:
            return self.channel.publish_abort(failure)
        except ChannelLost:
            return failure

    def _lost_node(self, node: int, extra: str = "") -> JobFailure:
        return self._abort_with(JobFailure(
            "lost", node, self.hosts[node], "the node agent",
            f"sent no heartbeat for {self.heartbeat_timeout_s:.0f} s (killed, or its machine is unreachable)"
            + extra, 1, restartable=False))

    def check(self, force: bool = False) -> JobFailure | None:
        """Anything elsewhere in the job that must stop this node's ranks now (None: carry on)."""
        now = time.monotonic()
        if self._seen is not None or not (force or now >= self._next_check):
            return self._seen
        self._next_check = now + WATCH_INTERVAL_S
        if self.stdin is not None and self.stdin.closed.is_set():
            self._seen = self._abort_with(JobFailure("abort", self.node_rank, self.host, "the launcher's ssh "
                                                     "connection", "closed (launcher stopped)", 1, restartable=False))
            return self._seen
        if self._heartbeat is not None and self._heartbeat.lost is not None:
            self._seen = self.store_lost(self._heartbeat.lost)
            return self._seen
        try:
            found = self.channel.abort() or self.channel.failure(self.round)
            if found is None and self.node_rank == 0:
                self.lost = self.channel.lost_nodes()
                if self.lost:
                    found = self._lost_node(self.lost[0])
        except ChannelLost as exc:
            found = self.store_lost(str(exc))
        self._seen = found
        return found

    def publish_rank_failure(self, stream: RankStream) -> JobFailure:
        """A rank of this node failed: publish it (first failure of the attempt wins) and, on node 0, blame
        a node that vanished when the rank only lost its connection to it."""
        mine = JobFailure("rank", self.node_rank, self.host, stream.who, f"exited with {stream.exit}",
                          exit_status(stream.returncode), rank=stream.rank, tail=stream.text())
        try:
            winner = self.channel.publish_failure(self.round, mine)
        except ChannelLost as exc:
            self._seen = self.store_lost(str(exc))
            return self._seen
        if self.node_rank == 0 and winner.kind == "rank" and any(m in winner.tail.lower() for m in _PEER_GONE):
            winner = self._blame_lost_node(winner)
        self._seen, self.mine = winner, mine
        return winner

    def _blame_lost_node(self, failure: JobFailure) -> JobFailure:
        deadline = time.monotonic() + self.heartbeat_timeout_s + 2 * WATCH_INTERVAL_S + 1.0
        try:
            while time.monotonic() < deadline:
                lost = self.channel.lost_nodes()
                if lost:
                    self.lost = lost
                    return self._lost_node(lost[0], f"; {failure.who} on host {failure.host} then lost its "
                                                    "connection to that node's ranks")
                time.sleep(0.2)
        except ChannelLost:
            pass
        return failure

    def abort(self, what: str, code: int) -> None:
        """This agent was signalled: stop the other nodes too."""
        if self.multi_node and self.channel is not None:
            self._abort_with(JobFailure("abort", self.node_rank, self.host, "the node agent", what, code,
                                        restartable=False))

    def report(self, failure: JobFailure | None, own_failed: bool, job: Any, attempt: int, restarting: bool) -> None:
        """Node 0 prints the job's failure with the rank's output; the failing node (unless all nodes share
        one terminal) its own; every node says what it does next."""
        mine = self.mine if own_failed else None
        if failure is None:
            return
        own = mine is not None and failure.kind == "rank" and failure.node == self.node_rank
        if self.node_rank != 0 and mine is not None and not job.report_on_node0:
            print(format_job_failure(mine, full=True), file=sys.stderr, flush=True)
        wanted = self.node_rank == 0 or (failure.kind == "lost" and failure.node == 0) or (
            not job.report_on_node0 and not own)
        if wanted and not (self.node_rank != 0 and own):
            print(format_job_failure(failure, full=self.node_rank == 0), file=sys.stderr, flush=True)
        ending = (f"restarting every rank (restart {attempt + 1} of {job.max_restarts})" if restarting
                  else f"exiting with code {failure.exit_code}")
        world = len(self.hosts)
        print(f"deepshard: node {self.node_rank} ({self.host}) stopped its {self.local_ranks} rank(s) on {world} "
              f"nodes; {ending}", file=sys.stderr, flush=True)
        self.mine = None

    def close(self) -> None:
        """End of the job: node 0 waits (briefly) for the others to leave before its store goes away."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if not self.multi_node or self.channel is None:
            return
        try:
            if self.node_rank == 0:
                self.channel.wait_exited(EXIT_WAIT_S, skip=self.lost)
            else:
                self.channel.mark_exited()
        except ChannelLost:
            pass


class ElasticRendezvous:
    """``--elastic_training``: torch's c10d rendezvous (node ranks by arrival, min..max nodes), with the few
    hooks :class:`~deepshard.launcher.agent.NodeAgent` calls; everything else is torch's handler."""

    multi_node = False
    where = ""

    def __init__(self, endpoint: str, run_id: str, min_nodes: int, max_nodes: int, environ: Mapping[str, str],
                 local_addr: str | None = None) -> None:
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        self.join_timeout_s = env_seconds(environ, "DEEPSHARD_JOIN_TIMEOUT", JOIN_TIMEOUT_S)
        params = RendezvousParameters("c10d", endpoint, run_id, min_nodes, max_nodes, local_addr,
                                      join_timeout=int(self.join_timeout_s), last_call_timeout=2)
        self._inner: RendezvousHandler = get_rendezvous_handler(params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def abort(self, what: str, code: int) -> None:
        """Signalled: torch's agent already stopped this node's ranks; the rendezvous stays open for the others."""

    def close(self) -> None:
        self._inner.shutdown()
