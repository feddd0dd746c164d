"""A static multi-node agent's link to the rest of the job, over the job board (:mod:`.board`): it publishes
the first failure of an attempt, sees another node's, names a node whose agent went silent, stops the job on a
signal or when the ssh launcher goes away, and prints the job's report."""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Mapping

from deepshard.launcher.board import HEARTBEAT_TIMEOUT_S, Heartbeat, JobBoard, JobFailure, StoreLost
from deepshard.launcher.options import env_seconds
from deepshard.launcher.output import exit_status, output_block
from deepshard.launcher.rank_streams import RankStream

EXIT_WAIT_S = 15.0
CHECK_INTERVAL_S = 0.25
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "closed its connection", "broken pipe")


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


class JobLink:
    """One node agent's link (``board``: the node's view of the job board)."""

    def __init__(self, board: JobBoard, environ: Mapping[str, str], stdin_close: bool = False,
                 report_on_node0: bool = False) -> None:
        self.board, self.node_rank, self.hosts = board, board.node_rank, board.hosts
        board.heartbeat_timeout_s = env_seconds(environ, "DEEPSHARD_HEARTBEAT_TIMEOUT", HEARTBEAT_TIMEOUT_S)
        self.report_on_node0 = report_on_node0
        self.stdin = _StdinWatch() if stdin_close else None
        self.heartbeat = Heartbeat(board) if self.node_rank != 0 else None
        self.lost: list[int] = []
        self.seen: JobFailure | None = None
        self.mine: JobFailure | None = None  # this node's own rank failure, until reported
        self._next_check = 0.0

    @property
    def host(self) -> str:
        return self.hosts[self.node_rank]

    def new_attempt(self) -> None:
        """What an ended attempt saw does not stop the next one."""
        self.seen, self.mine = None, None

    def store_lost(self, detail: str) -> JobFailure:
        return JobFailure("lost", 0, self.hosts[0], "the rendezvous store (node 0's agent)",
                          f"stopped answering: {detail}", 1, restartable=False)

    def _abort_with(self, failure: JobFailure) -> JobFailure:
        try:
            return self.board.publish_abort(failure)
        except StoreLost:
            return failure

    def _lost_node(self, node: int, extra: str = "") -> JobFailure:
        return self._abort_with(JobFailure(
            "lost", node, self.hosts[node], "the node agent",
            f"sent no heartbeat for {self.board.heartbeat_timeout_s:.0f} s (killed, or its machine is unreachable)"
            + extra, 1, restartable=False))

    def check(self, attempt: int, force: bool = False) -> JobFailure | None:
        """Anything elsewhere in the job that must stop this node's ranks now (None: carry on)."""
        now = time.monotonic()
        if self.seen is not None or not (force or now >= self._next_check):
            return self.seen
        self._next_check = now + CHECK_INTERVAL_S
        if self.stdin is not None and self.stdin.closed.is_set():
            self.seen = self._abort_with(JobFailure("abort", self.node_rank, self.host, "the launcher's ssh "
                                                    "connection", "closed (launcher stopped)", 1, restartable=False))
        elif self.heartbeat is not None and self.heartbeat.lost is not None:
            self.seen = self.store_lost(self.heartbeat.lost)
        else:
            try:
                self.seen = self.board.abort() or self.board.failure(attempt)
                if self.seen is None and self.node_rank == 0:
                    self.lost = self.board.lost_nodes()
                    self.seen = self._lost_node(self.lost[0]) if self.lost else None
            except StoreLost as exc:
                self.seen = self.store_lost(str(exc))
        return self.seen

    def publish_rank_failure(self, attempt: int, stream: RankStream) -> JobFailure:
        """A rank of this node failed: publish it (the attempt's first failure wins); returns the one that stands."""
        mine = JobFailure("rank", self.node_rank, self.host, stream.who, f"exited with {stream.exit}",
                          exit_status(stream.returncode), rank=stream.rank, tail=stream.text())
        try:
            self.seen, self.mine = self.board.publish_failure(attempt, mine), mine
        except StoreLost as exc:
            self.seen = self.store_lost(str(exc))
        return self.seen

    def blame(self, failure: JobFailure) -> JobFailure:
        """Node 0: a rank that only lost its connection to a node that vanished is not the cause; that node is."""
        if self.node_rank != 0 or failure.kind != "rank" or not any(m in failure.tail.lower() for m in _PEER_GONE):
            return failure
        deadline = time.monotonic() + self.board.heartbeat_timeout_s + 2 * CHECK_INTERVAL_S + 1.0
        try:
            while time.monotonic() < deadline:
                self.lost = self.board.lost_nodes()
                if self.lost:
                    return self._lost_node(self.lost[0], f"; {failure.who} on host {failure.host} then lost its "
                                                         "connection to that node's ranks")
                time.sleep(0.2)
        except StoreLost:
            pass
        return failure

    def abort(self, what: str, code: int) -> None:
        """This agent was signalled: stop the other nodes too."""
        self._abort_with(JobFailure("abort", self.node_rank, self.host, "the node agent", what, code,
                                    restartable=False))

    def report(self, failure: JobFailure, local_ranks: int, ending: str) -> None:
        """Node 0 prints the job's failure with the rank's output; the failing node (unless all nodes share one
        terminal) its own; every node says what it does next (``ending``)."""
        mine, self.mine = self.mine, None
        own = mine is not None and failure.kind == "rank" and failure.node == self.node_rank
        if self.node_rank != 0 and mine is not None and not self.report_on_node0:
            print(format_job_failure(mine, full=True), file=sys.stderr, flush=True)
        wanted = self.node_rank == 0 or (failure.kind == "lost" and failure.node == 0) or (
            not self.report_on_node0 and not own)
        if wanted and not (self.node_rank != 0 and own):
            print(format_job_failure(failure, full=self.node_rank == 0), file=sys.stderr, flush=True)
        print(f"deepshard: node {self.node_rank} ({self.host}) stopped its {local_ranks} rank(s) on {len(self.hosts)} "
              f"nodes; {ending}", file=sys.stderr, flush=True)

    def await_others(self, attempt: int) -> JobFailure | None:
        """This node's ranks all succeeded: wait until every node's did (None), or a failure elsewhere ends the
        job (a node whose ranks are done takes no part in a restart)."""
        try:
            self.board.mark_finished(attempt)
            while not self.board.all_finished(attempt):
                found = self.check(attempt, force=True)
                if found is not None:
                    return found
                time.sleep(0.1)
        except StoreLost as exc:
            return self.store_lost(str(exc))
        return None

    def close(self) -> None:
        """End of the job: node 0 waits (briefly) for the others to leave before its store goes away."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        try:
            if self.node_rank == 0:
                self.board.wait_exited(EXIT_WAIT_S, skip=self.lost)
            else:
                self.board.mark_exited()
        except StoreLost:
            pass
