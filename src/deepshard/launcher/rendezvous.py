"""How the node agents meet: torch's c10d rendezvous (the one ``torchrun --rdzv_backend c10d`` uses), static
jobs included (min = max nodes), its public handler subclassed to add deepshard's part: hostfile node ranks for
static jobs, a fresh store (on a free port of the first node) for every attempt's ranks, the attempt hooks of
:mod:`.agent`, and a watchdog over every wait of a (re)start."""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

from deepshard.launcher.board import JobBoard, StoreLost
from deepshard.launcher.local import NodeJob
from deepshard.launcher.options import LaunchError

RUN_ID = "deepshard"
STORE_TIMEOUT_S = 60
CONNECT_ATTEMPT_S = 2.0
WATCHDOG_MARGIN_S = 30.0


class AttemptHooks(Protocol):
    """What the agent's side (:class:`~deepshard.launcher.agent.JobWatch`) does at the rendezvous' calls: look at
    the job (every monitor interval, main thread), say how many waiting nodes count for a restart, and end an
    attempt (it may raise to end the job instead of restarting)."""

    def tick(self) -> bool: ...
    def nodes_waiting(self, count: int) -> int: ...
    def attempt_ended(self, restarting: bool) -> None: ...


class RendezvousFailed(RuntimeError):
    """The nodes did not meet: the message names what was waited for and how to fix it."""


@contextmanager
def watchdog(what: str, seconds: float, on_expire: Callable[[str], None] | None = None) -> Iterator[None]:
    """Bounds a wait that torch or the network could stretch forever: if the block is still open when the time is
    up, ``on_expire`` gets a message naming ``what`` was waited for (by default it is printed and the agent exits
    with status 1; its ranks die with it)."""
    timer = threading.Timer(seconds, on_expire or _give_up, args=(f"{what}: still waiting after {seconds:.0f} s; "
                                                                  "giving up (the job cannot go on)",))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _give_up(message: str) -> None:
    print(f"deepshard: {message}", file=sys.stderr, flush=True)
    os._exit(1)


class JobRendezvous(DynamicRendezvousHandler):
    """torch's c10d rendezvous handler, with each attempt's node rank, ranks' store and hooks deepshard's
    (:func:`open_rendezvous` makes one for a node's ``job``: static jobs have its hostfile node rank, elastic ones
    torch's)."""

    job: NodeJob
    join_timeout_s: float
    board: JobBoard | None = None
    hooks: AttemptHooks | None = None
    attempt = -1
    ranks_store: TCPStore | None = None  # this attempt's, on the first node: the previous one closes

    def next_rendezvous(self) -> RendezvousInfo:
        if self.attempt >= 0 and self.hooks is not None:
            self.hooks.attempt_ended(restarting=True)  # the previous attempt's ranks are gone
        self.attempt += 1
        where = f"attempt {self.attempt}: "
        limit = self.join_timeout_s + STORE_TIMEOUT_S + WATCHDOG_MARGIN_S
        with watchdog(f"{where}the nodes meeting in torch's c10d rendezvous at {self.job.endpoint}", limit):
            info = self._meet(where)
        rank, world = self._rank(info)
        with watchdog(f"{where}node 0's store for the ranks (announced in the rendezvous store)",
                      STORE_TIMEOUT_S + WATCHDOG_MARGIN_S):
            bootstrap = self._fresh_store(info.store, rank)
        return RendezvousInfo(info.store, rank, world, bootstrap)

    @property
    def use_agent_store(self) -> bool:
        return True  # the ranks connect to the store this handler serves; none of them hosts one

    def num_nodes_waiting(self) -> int:
        if self.hooks is not None and self.hooks.tick():
            return 0  # this attempt ends on the ranks' exits: a failure, not a change of nodes
        waiting = super().num_nodes_waiting()
        return self.hooks.nodes_waiting(waiting) if waiting and self.hooks is not None else waiting

    # ---------------------------------------------------------------------- deepshard's part

    def _meet(self, where: str) -> RendezvousInfo:
        try:
            return super().next_rendezvous()
        except RendezvousTimeoutError:
            raise RendezvousFailed(f"{where}{self._absent()} within {self.join_timeout_s:.0f} s "
                                   f"(DEEPSHARD_JOIN_TIMEOUT); start the same command there, check that it can "
                                   f"reach {self.job.endpoint}, or raise DEEPSHARD_JOIN_TIMEOUT (seconds)") from None
        except RendezvousClosedError:
            raise RendezvousFailed(f"{where}the rendezvous at {self.job.endpoint} was closed: another node "
                                   "ended the job") from None

    def _absent(self) -> str:
        if self.board is None:
            return f"fewer than {self.job.node_range[0]} node(s) joined the rendezvous"
        try:
            missing = self.board.missing()
        except StoreLost:
            missing = []
        return f"{', '.join(f'node {n} ({self.job.hosts[n]})' for n in missing) or 'some nodes'} did not join"

    def _rank(self, info: RendezvousInfo) -> tuple[int, int]:
        """Static jobs: the hostfile's node rank, once every node's command line is known to match."""
        if self.job.elastic is not None:
            return info.rank, info.world_size
        if self.board is not None:
            problem = self.board.check_job()
            if problem is not None:
                raise LaunchError(problem)
        return self.job.node_rank, len(self.job.hosts)

    def _fresh_store(self, store: Store, rank: int) -> RendezvousStoreInfo:
        """Each attempt's ranks meet in a new store on a free port of the first node, announced in this round
        of the rendezvous: nothing a dead rank published is found by its successor."""
        port, rank0_addr = None, None if self.job.elastic else self.job.master_addr  # elastic: node 0's name
        if rank == 0:
            self.ranks_store = TCPStore(rank0_addr or "0.0.0.0", 0, is_master=True,
                                         wait_for_workers=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
            port = self.ranks_store.port
        # this round's store (torch prefixes it by round): the same on every node, whatever each one counts
        return RendezvousStoreInfo.build(rank, PrefixStore("deepshard/ranks", store), rank0_addr,
                                         server_port=port)


def open_rendezvous(job: NodeJob, join_timeout_s: float, is_host: bool | None) -> JobRendezvous:
    """torch's c10d rendezvous for this node's ``job`` at ``master_addr:master_port`` (node 0 serving its store
    when ``is_host``; None: torch decides by the endpoint's name, for elastic jobs); static multi-node jobs also
    get their board."""
    low, high = job.node_range
    params = RendezvousParameters("c10d", job.endpoint, RUN_ID, low, high, read_timeout=STORE_TIMEOUT_S,
                                  **({} if is_host is None else {"is_host": is_host}))
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # the ranks' store is this module's
    client = None if is_host is not False else _reach(job.endpoint, join_timeout_s)
    timeout = RendezvousTimeout(datetime.timedelta(seconds=int(join_timeout_s)), datetime.timedelta(seconds=2))
    try:
        backend, store = create_backend(params)
        rdzv = JobRendezvous.from_backend(RUN_ID, store, backend, low, high, timeout=timeout)
    except Exception as exc:  # torch raises RendezvousConnectionError or RuntimeError with the cause inside
        cause = exc.__cause__ or exc
        raise RendezvousFailed(_cannot_open(job.endpoint, join_timeout_s, is_host, str(cause).splitlines()[0]
                                            if str(cause) else type(cause).__name__)) from exc
    rdzv.job, rdzv.join_timeout_s = job, join_timeout_s
    if job.elastic is None and len(job.hosts) > 1:
        store = PrefixStore(f"deepshard/{RUN_ID}", client or _reach(job.endpoint, join_timeout_s))
        rdzv.board = JobBoard(store, job.node_rank, job.hosts, stdin_close=job.exit_on_stdin_close,
                              report_on_node0=job.report_on_node0)
        rdzv.board.register(job.fingerprint())
    return rdzv


def _cannot_open(endpoint: str, join_timeout_s: float, is_host: bool | None, detail: str) -> str:
    if is_host:
        return (f"node 0 cannot serve the rendezvous store at {endpoint} ({detail}); the port must be free: "
                "pick another --master_port")
    return (f"cannot reach the rendezvous store at {endpoint} within {join_timeout_s:.0f} s ({detail}); "
            "start node 0 with the same command, check --master_addr / --master_port, and that the port is open "
            "between the nodes")


def _reach(endpoint: str, join_timeout_s: float) -> TCPStore:
    """A client of node 0's rendezvous store, tried in short attempts until the join timeout (so Ctrl-C is
    honoured while node 0 is not up yet)."""
    host, _, port = endpoint.rpartition(":")
    deadline = time.monotonic() + join_timeout_s
    while True:
        attempt = max(0.1, min(CONNECT_ATTEMPT_S, deadline - time.monotonic()))
        try:
            store = TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=attempt))
        except RuntimeError as exc:
            if time.monotonic() >= deadline:
                raise RendezvousFailed(_cannot_open(endpoint, join_timeout_s, False, str(exc).splitlines()[0])) from exc
            continue
        store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
        return store
