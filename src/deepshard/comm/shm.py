"""All-gather and reduce-scatter through shared memory, for the ranks of a gloo group on one host.

Between processes on one host, gloo moves data over loopback TCP (about 1.2 GB/s here): a 16 MiB
exchange between two ranks costs 14-22 ms, and ZeRO-3 moves 3x the model per step against DDP's 2x. Here
each rank owns an *outbox* file in ``/dev/shm`` that every rank of the group has mapped: a collective
copies this rank's data into its outbox, publishes a round number, waits for the peers' round, and copies
(all-gather) or sums (reduce-scatter) straight out of their outboxes. Measured on 2 processes of a 2-core
host (``benchmarks/shm_bench.py``, fp32, median ms of 30 calls, 1 MiB slots, load average 1.95):

    ========================  =========  =========  ==========  ==========
    collective                4 MiB TCP  4 MiB shm  16 MiB TCP  16 MiB shm
    ========================  =========  =========  ==========  ==========
    all_gather_into_tensor         2.25       0.81        9.62        3.62
    reduce_scatter_pieces          2.74       1.07        9.77        4.70
    ========================  =========  =========  ==========  ==========

A ZeRO-3 step of the ~100M-parameter MLP workloads (``mlp``, ``mlp12``; 2 processes) took 0.85-1.03 s
against 1.34-1.43 s over TCP, with the same losses and peak memory.

**Run at wait, in issue order, whole.** An issued collective is queued; waiting on it runs it, and every
collective the group issued before it, to completion inside the call (copy in, signal, wait for the
peers, copy or sum out). On a busy 2-core host no core is idle to overlap a transfer with (gloo's
"asynchronous" TCP transfer is a kernel memcpy on the same cores), so running at wait costs nothing, and
it keeps the watchdog's contract: a rank never blocks at issue time, a wait is bounded by its timeout
(False: the watchdog names the missing ranks), and a peer whose process is gone fails the wait as a lost
connection does. Running whole collectives in issue order also avoids the deadlock of a queued design
(a sender waiting for a slot that its receiver frees only when it waits) without a progress thread.
The inputs must stay unchanged until the wait, as for the pairwise forms.

**Outbox.** A 4 KiB control header, then two slots of ``slot_bytes`` (default 1 MiB, ``DEEPSHARD_SHM_SLOT_MB``)
used alternately by consecutive rounds, so a rank writes round ``t + 1`` while a slower peer still reads
round ``t``; a larger collective runs in several rounds. Slots of 0.5 to 16 MiB measured alike (within the
noise of a 2-core host) from 4 to 64 MiB collectives, 0.25 MiB was slower; 1 MiB keeps the memory small.
Memory added per process: its own outbox plus the parts of its peers' it reads, at most
``2 * N * slot_bytes`` resident (4 MiB for 2 ranks; shared pages count in each process's resident set),
and nothing else: the reduce-scatter sums out of the peers' outboxes into its result chunk, where the
pairwise form receives ``N - 1`` chunks (the same on 2 ranks, ``N - 2`` chunks less on more).

**Signals.** The header holds this rank's last written round, its last fully read round, and a
fingerprint of each slot's collective (its sequence number, kind and size, as the pairwise tags). A rank
writes round ``t`` once every peer has read round ``t - 2`` (the slot is free); it reads once every peer
has written round ``t`` with the same fingerprint (ranks that issued different collectives raise instead
of exchanging the wrong data). Waits yield the core 200 times, then sleep: 30 us at first, then for 5%
of the time already waited, at most 10 ms (never a long busy spin: on 2 cores the compute threads need
the CPU; and a long wait, for peers that wait for a core, wakes up ~100 times a second, not ~10,000).

**Rendezvous.** At a group's first run the ranks exchange (host name, a token from group rank 0, their
process ids) over pairwise TCP, under the same deadline; only when every rank is on this host,
``/dev/shm`` has room and every rank mapped every outbox is the transport used, else the group keeps the
pairwise TCP forms for its life (one log line). Each rank unlinks its own file once all have mapped it,
so nothing stays in ``/dev/shm`` past the rendezvous, whatever happens to the processes later.

Results are bit-identical to ``pairwise``: the same summation order (the canonical tree over ranks of
``tree_sum.py``), 16-bit chunks from more than two ranks summed in fp32.
"""
from __future__ import annotations

import datetime
import hashlib
import logging
import mmap
import os
import secrets
import socket
import time
from collections import deque
from typing import Callable, Optional

import torch
import torch.distributed as dist

import deepshard.comm.pairwise as pairwise
from deepshard.comm.pairwise import CollectiveWork
from deepshard.comm.settings import DEFAULT_SLOT_BYTES
from deepshard.comm.shm_ring import HEADER_BYTES, Late, ShmRing, _alive
from deepshard.comm.watchdog import CollectiveTimeout, WaitLimit
from deepshard.utils.logging import logger

HOST_VAR = "DEEPSHARD_SHM_HOST"
"""Overrides this host's name in the rendezvous (tests use it to put ranks on "different hosts")."""
SHM_DIR = "/dev/shm"


def _host_id() -> int:
    host = os.environ.get(HOST_VAR, "").strip() or socket.gethostname()
    return int.from_bytes(hashlib.sha1(host.encode()).digest()[:7], "little")


def _room(nbytes: int) -> bool:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= 2 * nbytes  # the whole group's outboxes, with a margin


def _create(path: str, nbytes: int) -> Optional[mmap.mmap]:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    except OSError:
        os.unlink(path)
        return None
    finally:
        os.close(fd)


def _open(path: str, nbytes: int) -> Optional[mmap.mmap]:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        return mmap.mmap(fd, nbytes) if os.fstat(fd).st_size >= nbytes else None
    except OSError:
        return None
    finally:
        os.close(fd)


class _Op:
    """One issued collective: ``shm(ring, deadline)`` runs it over shared memory and returns its result;
    ``tcp()`` starts it as pairwise exchanges (when the rendezvous kept the group on TCP)."""

    def __init__(self, shm: Callable[[ShmRing, float], Optional[torch.Tensor]],
                 tcp: Callable[[], CollectiveWork]) -> None:
        self.shm, self.tcp = shm, tcp
        self.done = False
        self.result: Optional[torch.Tensor] = None


class ShmWork:
    """Handle of a collective queued on a :class:`ShmTransport`. ``wait()`` runs it, after every collective
    issued on the group before it, within ``timeout`` (False when a peer did not arrive in time: the
    watchdog then diagnoses); ``result`` is the reduce-scatter's chunk afterwards."""

    def __init__(self, transport: "ShmTransport", op: _Op, what: str, scratch_bytes: int = 0) -> None:
        self._transport, self._op, self._what = transport, op, what
        self.result: Optional[torch.Tensor] = None
        self.scratch_bytes = scratch_bytes

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        if not self._op.done:
            limit = self._transport.limit
            seconds = limit.seconds if timeout is None else timeout.total_seconds()
            try:
                self._transport.run_through(self._op, time.monotonic() + seconds)
            except Late as late:
                if timeout is not None:
                    return False
                raise CollectiveTimeout(f"rank {self._transport.peers[self._transport.rank]}: {self._what} over "
                                        f"shared memory did not complete within {seconds:g}s ({limit.source}): "
                                        f"{late}.") from None
        self.result = self._op.result
        return True

    def is_completed(self) -> bool:
        return self._op.done


class ShmTransport:
    """A group's shared-memory collectives: issued ones wait in a queue and run, in issue order, when one
    of them is waited on (so every rank runs them in the same order, and no rank ever blocks at issue
    time on a peer that is still computing). The first run is the rendezvous, bounded by the wait's
    deadline like any collective; ``tags`` are the three pairwise tags it uses."""

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, peers: list[int], name: str,
                 slot_bytes: int, limit: WaitLimit, tags: list[int]) -> None:
        self.group, self.rank, self.peers, self.name = group, rank, peers, name
        self.slot_bytes, self.limit, self._tags = slot_bytes, limit, tags
        self.state = "pending"  # then "shm" or "tcp" for the life of the group
        self.ring: Optional[ShmRing] = None
        self.paths: list[str] = []
        self._queue: deque[_Op] = deque()
        self._failed: Optional[str] = None

    @property
    def queues(self) -> bool:
        """Whether new collectives go through this transport (False once the group fell back to TCP)."""
        return self.state != "tcp"

    # ------------------------------------------------------------------------------ collectives
    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, tag: int, what: str) -> ShmWork:
        """``pairwise.all_gather`` over shared memory (``shard`` may be chunk ``rank`` of ``output``)."""
        size = len(self.peers)
        if not output.is_contiguous():
            raise ValueError("all_gather: the output tensor must be contiguous (it is received into in place)")
        if shard.numel() * size != output.numel():
            raise ValueError(f"all_gather: shard has {shard.numel()} elements, expected {output.numel() // size} "
                             f"(output of {output.numel()} over {size} ranks)")
        op = _Op(lambda ring, deadline: ring.all_gather(output, shard, tag * 8 + 1, deadline, what),
                 lambda: pairwise.all_gather(output, shard, self.rank, self.peers, self.group, tag))
        return self._submit(op, what)

    def reduce_scatter_tensor(self, output: torch.Tensor, full: torch.Tensor, tag: int, what: str) -> ShmWork:
        """``pairwise.reduce_scatter`` over shared memory (``output`` may be chunk ``rank`` of ``full``)."""
        size = len(self.peers)
        if not (full.is_contiguous() and output.is_contiguous()):
            raise ValueError("reduce_scatter: input and output tensors must be contiguous")
        if output.numel() * size != full.numel():
            raise ValueError(f"reduce_scatter: output has {output.numel()} elements, expected "
                             f"{full.numel() // size} (input of {full.numel()} over {size} ranks)")
        op = _Op(lambda ring, deadline: ring.reduce_scatter([full.reshape(-1)], output.numel(), tag * 8 + 2,
                                                            deadline, what, output=output),
                 lambda: pairwise.reduce_scatter(output, full, self.rank, self.peers, self.group, tag))
        return self._submit(op, what)

    def reduce_scatter_pieces(self, pieces: list[torch.Tensor], chunk: int, tag: int, what: str) -> ShmWork:
        """``pairwise.reduce_scatter_pieces`` over shared memory; the work's ``result`` is the chunk."""
        total = sum(p.numel() for p in pieces)
        if total > len(self.peers) * chunk:
            raise ValueError(f"reduce_scatter_pieces: {total} elements do not fit {len(self.peers)} chunks of {chunk}")
        op = _Op(lambda ring, deadline: ring.reduce_scatter(pieces, chunk, tag * 8 + 3, deadline, what),
                 lambda: pairwise.reduce_scatter_pieces(pieces, chunk, self.rank, self.peers, self.group, tag))
        return self._submit(op, what, scratch_bytes=chunk * pieces[0].element_size())

    def _submit(self, op: _Op, what: str, scratch_bytes: int = 0) -> ShmWork:
        self._queue.append(op)
        return ShmWork(self, op, what, scratch_bytes)

    # ------------------------------------------------------------------------------------ running
    def run_through(self, op: _Op, deadline: float) -> None:
        """Run the queued collectives up to and including ``op``. A collective that failed or timed out
        leaves the rounds of the ranks out of step: the group is unusable after it."""
        if self._failed is not None:
            raise RuntimeError(self._failed)
        while not op.done:
            head = self._queue[0]
            try:
                self._run(head, deadline)
            except BaseException as err:
                self._failed = (f"a collective over shared memory of group {self.name!r} timed out or failed "
                                f"earlier ({err}); the group cannot be used after it")
                raise
            self._queue.popleft()

    def _run(self, op: _Op, deadline: float) -> None:
        if self.state == "pending":
            self._connect(deadline)
        if self.ring is not None:
            op.result = op.shm(self.ring, deadline)
        else:
            work = op.tcp()
            left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
            if work.wait(timeout=left) is False:
                raise Late([p for r, p in enumerate(self.peers) if r != self.rank], "arrive")
            op.result = work.result
        op.done = True

    # --------------------------------------------------------------------------------- rendezvous
    def _exchange(self, values: list[int], step: int, deadline: float) -> torch.Tensor:
        """Every rank's ``values`` (a row per group rank), over the pairwise TCP path."""
        out = torch.empty((len(self.peers), len(values)), dtype=torch.int64)
        work = pairwise.all_gather(out, torch.tensor(values, dtype=torch.int64), self.rank, self.peers,
                                   self.group, self._tags[step])
        left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        if work.wait(timeout=left) is False:
            raise Late([p for r, p in enumerate(self.peers) if r != self.rank], "arrive")
        return out

    def _connect(self, deadline: float) -> None:
        """Map every rank's outbox when all ranks are on this host with room in ``/dev/shm``; else TCP."""
        size, nbytes = len(self.peers), HEADER_BYTES + 2 * self.slot_bytes
        token = secrets.randbits(62) if self.rank == 0 else 0
        info = self._exchange([_host_id(), token, int(_room(size * nbytes)), os.getpid()], 0, deadline)
        hosts = len(set(info[:, 0].tolist()))
        if hosts > 1 or not bool(info[:, 2].all()):
            why = f"its ranks are on {hosts} hosts" if hosts > 1 else f"{SHM_DIR} is missing or too small"
            self._fall_back(f"collectives over TCP, not shared memory: {why}", logging.INFO)
            return
        safe = "".join(c if c.isalnum() else "_" for c in self.name)
        paths = [os.path.join(SHM_DIR, f"deepshard-{int(info[0, 1]):x}-{safe}-{r}") for r in range(size)]
        own = _create(paths[self.rank], nbytes)
        try:
            created = self._exchange([int(own is not None)], 1, deadline)
            maps = [own if r == self.rank else (_open(p, nbytes) if bool(created.all()) else None)
                    for r, p in enumerate(paths)]
            mapped = self._exchange([int(all(m is not None for m in maps))], 2, deadline)  # then unlink
        finally:
            if own is not None:
                os.unlink(paths[self.rank])
        if not bool(mapped.all()):
            self._fall_back(f"shared-memory outboxes could not be created or mapped in {SHM_DIR}; "
                            "collectives stay on TCP", logging.WARNING)
            return
        # a peer whose process this rank cannot see (another pid namespace) is not checked for liveness
        pids = [p if r == self.rank or _alive(p) else 0 for r, p in enumerate(info[:, 3].tolist())]
        self.ring = ShmRing([m for m in maps if m is not None], self.rank, self.peers, pids, self.slot_bytes)
        self.paths, self.state = paths, "shm"

    def _fall_back(self, message: str, level: int) -> None:
        self.state = "tcp"
        if self.rank == 0:
            logger.log(level, f"group {self.name!r}: {message}")
