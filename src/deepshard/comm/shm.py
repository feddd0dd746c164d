"""All-gather and reduce-scatter through shared memory, for the ranks of a gloo group on one host.

Between processes on one host, gloo moves data over loopback TCP (about 1.2 GB/s here): a 16 MiB
exchange between two ranks costs 14-22 ms, and ZeRO-3 moves 3x the model per step against DDP's 2x. Here
each rank owns an *outbox* file in ``/dev/shm`` that every rank of the group has mapped: a collective
copies this rank's data into its outbox, publishes a round number, waits for the peers' round, and copies
(all-gather) or sums (reduce-scatter) straight out of their outboxes. Measured on 2 processes of a 2-core
host (``benchmarks/shm_bench.py``, fp32, median ms per call; the module's defaults):

    ========================  ==========  ===========  =========  ==========
    collective                4 MiB TCP   4 MiB shm    16 MiB TCP 16 MiB shm
    ========================  ==========  ===========  =========  ==========
    all_gather_into_tensor    SEE_AG4T    SEE_AG4S     SEE_AG16T  SEE_AG16S
    reduce_scatter_pieces     SEE_RS4T    SEE_RS4S     SEE_RS16T  SEE_RS16S
    ========================  ==========  ===========  =========  ==========

**Synchronous.** A collective completes inside the call and returns a completed handle, so callers wait
on it as on any other. On a busy 2-core host no core is idle to overlap a transfer with (gloo's
"asynchronous" TCP transfer is a kernel memcpy on the same cores), and a queued design would deadlock (a
sender waiting for a slot that its receiver frees only when it waits) unless a progress thread ran.

**Outbox.** A 4 KiB control header, then two slots of ``slot_bytes`` (default 1 MiB, ``DEEPSHARD_SHM_SLOT_MB``)
used alternately by consecutive rounds, so a rank writes round ``t + 1`` while a slower peer still reads
round ``t``; a larger collective runs in several rounds. Slots of 0.5 to 16 MiB measured alike (within the
noise of a 2-core host) from 4 to 64 MiB collectives, 0.25 MiB was slower; 1 MiB keeps the memory small.
Memory added per process: its own outbox plus the parts of its peers' it reads, at most
``2 * N * slot_bytes`` resident (4 MiB for 2 ranks; shared pages count in each process's resident set),
and nothing else: the reduce-scatter sums out of the peers' outboxes, with none of the pairwise form's
``N - 1`` receive chunks (a 16 MiB reduce-scatter over 2 ranks allocates 8 MiB less).

**Signals.** The header holds this rank's last written round, its last fully read round, and a
fingerprint of each slot's collective (its sequence number, kind and size, as the pairwise tags). A rank
writes round ``t`` once every peer has read round ``t - 2`` (the slot is free); it reads once every peer
has written round ``t`` with the same fingerprint (ranks that issued different collectives raise instead
of exchanging the wrong data). Waits yield the core, then sleep in short steps; the group's watchdog
timeout bounds them (:class:`CollectiveTimeout` names the collective and the ranks that did not arrive).

**Rendezvous.** At a group's first eligible collective the ranks exchange (host name, a token from group
rank 0); only when every rank is on this host, ``/dev/shm`` has room and every rank mapped every outbox is
the transport used, else the group keeps the pairwise TCP forms for its life (one log line). Each rank
unlinks its own file once all have mapped it, so nothing stays in ``/dev/shm``, even after a crash.

Results are bit-identical to ``pairwise``: the same summation order (the chunk from rank ``r - 1``, this
rank's own, then ranks ``r - 2, r - 3, ...``), 16-bit chunks from more than two ranks summed in fp32.
"""
from __future__ import annotations

import logging
import mmap
import os
import socket
import time
import uuid
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from deepshard.comm.pairwise import CollectiveWork, piece_ranges
from deepshard.comm.watchdog import CollectiveTimeout, WaitLimit
from deepshard.utils.hugepages import advise_huge_pages
from deepshard.utils.logging import logger

MODE_VAR = "DEEPSHARD_SHM"
SLOT_VAR = "DEEPSHARD_SHM_SLOT_MB"
HOST_VAR = "DEEPSHARD_SHM_HOST"
"""Overrides this host's name in the rendezvous (tests use it to put ranks on "different hosts")."""
SHM_DIR = "/dev/shm"
DEFAULT_SLOT_BYTES = 1 << 20
HEADER_BYTES = 4096
_WRITTEN, _READ, _PRINT = 0, 1, 2  # header words: last written round, last fully read round, fingerprints
_YIELDS = 200  # waits first yield the core this many times, then sleep
_SLEEP_S = 30e-6


def mode_from(value: Optional[bool], environ: Mapping[str, str]) -> Optional[bool]:
    """The transport setting: ``value`` when given, else ``DEEPSHARD_SHM`` (auto/1: used where every rank
    of a gloo group is on one host; 0: never). None means auto."""
    if value is not None:
        return bool(value)
    raw = environ.get(MODE_VAR, "auto").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in ("0", "1"):
        return raw == "1"
    raise ValueError(f"{MODE_VAR}={raw!r}: use auto, 1 (shared memory between ranks on one host) or 0 (TCP)")


def slot_bytes_from(environ: Mapping[str, str]) -> int:
    """The outbox slot size: ``DEEPSHARD_SHM_SLOT_MB`` (MiB, may be fractional) or 1 MiB."""
    raw = environ.get(SLOT_VAR, "").strip()
    if not raw:
        return DEFAULT_SLOT_BYTES
    try:
        mib = float(raw)
    except ValueError:
        raise ValueError(f"{SLOT_VAR}={raw!r} is not a number of MiB; e.g. {SLOT_VAR}=4") from None
    if not mib > 0:
        raise ValueError(f"{SLOT_VAR}={raw!r} must be a positive number of MiB")
    return max(4096, int(mib * (1 << 20)) // 4096 * 4096)


class ShmRing:
    """The mapped outboxes of one group (one per rank, index = group rank) and the round sequence.
    Built by :func:`connect`; every rank of the group issues the same collectives in the same order."""

    def __init__(self, maps: list[mmap.mmap], rank: int, peers: list[int], slot_bytes: int,
                 limit: WaitLimit, paths: list[str]) -> None:
        self.rank, self.size, self.peers = rank, len(maps), peers
        self.paths = paths
        """Where the outboxes were created (unlinked once every rank mapped them)."""
        self.slot_bytes, self.limit = slot_bytes, limit
        self._maps = maps  # kept alive: the views below point into them
        self._heads = [memoryview(m)[:HEADER_BYTES].cast("q") for m in maps]
        self._slots = [torch.frombuffer(m, dtype=torch.uint8, offset=HEADER_BYTES).view(2, slot_bytes)
                       for m in maps]
        self._round = 0

    # ------------------------------------------------------------------------------------ rounds
    def _write_begin(self, what: str) -> tuple[int, torch.Tensor]:
        """The next round number and this rank's free slot for it (waits until every peer read the
        round that used it last)."""
        t = self._round + 1
        self._wait(_READ, t - 2, what, "finish reading the previous round")
        return t, self._slots[self.rank][t % 2]

    def _publish(self, t: int, fingerprint: int) -> None:
        head = self._heads[self.rank]
        head[_PRINT + t % 2] = fingerprint
        head[_WRITTEN] = t  # x86 keeps stores in order: the data and fingerprint are visible first

    def _await_peers(self, t: int, fingerprint: int, what: str) -> None:
        self._wait(_WRITTEN, t, what, "arrive")
        wrong = [self.peers[r] for r in range(self.size) if self._heads[r][_PRINT + t % 2] != fingerprint]
        if wrong:
            raise CollectiveTimeout(
                f"rank {self.peers[self.rank]}: {what} over shared memory failed: rank(s) {wrong} issued a "
                "different collective at this point (another kind, size or order). Every rank must issue the "
                "same collectives in the same order; look for rank-dependent code around this call.")

    def _read_done(self, t: int) -> None:
        self._heads[self.rank][_READ] = t
        self._round = t

    def _wait(self, word: int, target: int, what: str, doing: str) -> None:
        """Until every peer's header ``word`` reaches ``target``: yield, then sleep; bounded by the limit."""
        late = [r for r in range(self.size) if r != self.rank and self._heads[r][word] < target]
        spins, deadline = 0, None
        while late:
            late = [r for r in late if self._heads[r][word] < target]
            if not late:
                return
            spins += 1
            if spins <= _YIELDS:
                os.sched_yield()
                continue
            if deadline is None:
                deadline = time.monotonic() + self.limit.seconds
            elif time.monotonic() > deadline:
                raise CollectiveTimeout(
                    f"rank {self.peers[self.rank]}: {what} over shared memory did not complete within "
                    f"{self.limit.seconds:g}s ({self.limit.source}): rank(s) {[self.peers[r] for r in late]} "
                    f"did not {doing} (round {target}). They are still computing, stuck in another operation, "
                    "or dead; a rank that raised or exited shows its own error above.")
            time.sleep(_SLEEP_S)

    # ------------------------------------------------------------------------------ collectives
    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, fingerprint: int, what: str) -> CollectiveWork:
        """Concatenate every rank's ``shard`` into the contiguous ``output`` in rank order (``shard`` may be
        chunk ``rank`` of ``output``)."""
        if not output.is_contiguous():
            raise ValueError("all_gather: the output tensor must be contiguous")
        chunks = output.reshape(self.size, -1)
        mine = shard.reshape(-1)
        if mine.numel() != chunks.shape[1]:
            raise ValueError(f"all_gather: shard has {mine.numel()} elements, expected {chunks.shape[1]} "
                             f"(output of {output.numel()} over {self.size} ranks)")
        if mine.data_ptr() != chunks[self.rank].data_ptr():
            chunks[self.rank].copy_(mine)
        dest = chunks.view(torch.uint8) if chunks.numel() else chunks
        src = dest[self.rank]
        for lo in range(0, src.numel(), self.slot_bytes):
            n = min(self.slot_bytes, src.numel() - lo)
            t, slot = self._write_begin(what)
            slot[:n].copy_(src[lo:lo + n])
            self._publish(t, fingerprint)
            self._await_peers(t, fingerprint, what)
            for k in range(1, self.size):
                r = (self.rank + k) % self.size
                dest[r, lo:lo + n].copy_(self._slots[r][t % 2][:n])
            self._read_done(t)
        return CollectiveWork([])

    def reduce_scatter_tensor(self, output: torch.Tensor, full: torch.Tensor, fingerprint: int,
                              what: str) -> CollectiveWork:
        """Sum ``full`` (N equal chunks) over the ranks into ``output`` (may be chunk ``rank`` of ``full``)."""
        if not (full.is_contiguous() and output.is_contiguous()):
            raise ValueError("reduce_scatter: input and output tensors must be contiguous")
        if output.numel() * self.size != full.numel():
            raise ValueError(f"reduce_scatter: output has {output.numel()} elements, expected "
                             f"{full.numel() // self.size} (input of {full.numel()} over {self.size} ranks)")
        return self.reduce_scatter([full.reshape(-1)], output.numel(), fingerprint, what, output=output)

    def reduce_scatter(self, pieces: list[torch.Tensor], chunk: int, fingerprint: int, what: str,
                       output: Optional[torch.Tensor] = None) -> CollectiveWork:
        """Sum the concatenation of the 1-D ``pieces`` (zero-padded to ``N * chunk``) over the ranks; the
        work's ``result`` is chunk ``rank`` of the sum (``output`` when given: it may be that chunk of the
        only piece). Same summation order and 16-bit handling as ``pairwise.reduce_scatter_pieces``."""
        numels = [p.numel() for p in pieces]
        if sum(numels) > self.size * chunk:
            raise ValueError(f"reduce_scatter: {sum(numels)} elements do not fit {self.size} chunks of {chunk}")
        dtype = pieces[0].dtype
        wide = self.size > 2 and dtype.itemsize < 4  # summed in fp32, rounded once
        direct = output is not None and not wide
        acc = output.reshape(-1) if direct else torch.empty(chunk, dtype=torch.float32 if wide else dtype)
        if not direct:
            advise_huge_pages(acc)
        per_round = self.slot_bytes // ((self.size - 1) * dtype.itemsize)
        for lo in range(0, chunk, per_round):
            n = min(per_round, chunk - lo)
            t, slot = self._write_begin(what)
            self._fill(slot, pieces, numels, chunk, lo, n, per_round, dtype)
            self._publish(t, fingerprint)
            self._await_peers(t, fingerprint, what)
            self._sum(acc[lo:lo + n], t, pieces, numels, chunk, lo, per_round, wide)
            self._read_done(t)
        if output is not None:
            result = output if direct else output.copy_(acc.reshape(output.shape))
        else:
            result = acc.to(dtype) if wide else acc
        return CollectiveWork([], lambda: result, scratch_bytes=0 if direct else acc.numel() * acc.element_size())

    def _block(self, r: int, t: int, k: int, n: int, per_round: int, dtype: torch.dtype) -> torch.Tensor:
        """Block ``k - 1`` of rank ``r``'s slot of round ``t``: what ``r`` sends to rank ``r + k``."""
        size = dtype.itemsize
        start = (k - 1) * per_round * size
        return self._slots[r][t % 2][start:start + n * size].view(dtype)

    def _fill(self, slot: torch.Tensor, pieces: list[torch.Tensor], numels: list[int], chunk: int,
              lo: int, n: int, per_round: int, dtype: torch.dtype) -> None:
        """Write elements ``[lo, lo + n)`` of every other rank's chunk into this round's blocks (zeros where
        the pieces end)."""
        size = dtype.itemsize
        for k in range(1, self.size):
            dst = (self.rank + k) % self.size
            start = (k - 1) * per_round * size
            block = slot[start:start + n * size].view(dtype)
            at = 0
            for i, off, m in piece_ranges(numels, dst * chunk + lo, dst * chunk + lo + n):
                block[at:at + m].copy_(pieces[i][off:off + m])
                at += m
            if at < n:
                block[at:].zero_()

    def _sum(self, acc: torch.Tensor, t: int, pieces: list[torch.Tensor], numels: list[int], chunk: int,
             lo: int, per_round: int, wide: bool) -> None:
        """``acc`` = the block from rank ``r - 1`` + this rank's own elements + the blocks from ranks
        ``r - 2, r - 3, ...`` (the pairwise order). ``acc`` may be this rank's own elements (in-place
        reduce-scatter): each element is read before it is written."""
        n, dtype = acc.numel(), pieces[0].dtype
        first = self._block((self.rank - 1) % self.size, t, 1, n, per_round, dtype)
        at = 0
        begin = self.rank * chunk + lo
        for i, off, m in piece_ranges(numels, begin, begin + n):
            if wide:  # widen first, then add: as pairwise's fp32 accumulator
                acc[at:at + m].copy_(first[at:at + m])
                acc[at:at + m].add_(pieces[i][off:off + m])
            else:
                torch.add(first[at:at + m], pieces[i][off:off + m], out=acc[at:at + m])
            at += m
        if at < n:  # the zero padding of the last chunk
            acc[at:].copy_(first[at:])
        for k in range(2, self.size):
            acc.add_(self._block((self.rank - k) % self.size, t, k, n, per_round, dtype))


def _host() -> str:
    return os.environ.get(HOST_VAR, "").strip() or socket.gethostname()


def _room(nbytes: int) -> bool:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= 2 * nbytes  # the whole group's outboxes, with a margin


def _gather(obj: Any, group: Optional[dist.ProcessGroup], size: int) -> list[Any]:
    box: list[Any] = [None] * size
    dist.all_gather_object(box, obj, group=group)
    return box


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


def connect(group: Optional[dist.ProcessGroup], rank: int, peers: list[int], name: str,
            slot_bytes: int, limit: WaitLimit) -> Optional[ShmRing]:
    """Map the outboxes of every rank of ``group`` (collective: every rank calls it at the same point), or
    None when a rank is on another host or shared memory is unavailable (then the caller keeps TCP)."""
    size = len(peers)
    nbytes = HEADER_BYTES + 2 * slot_bytes
    token = uuid.uuid4().hex[:16] if rank == 0 else ""
    infos = _gather((_host(), token, _room(size * nbytes)), group, size)
    hosts = {h for h, _, _ in infos}
    if len(hosts) > 1 or not all(ok for _, _, ok in infos):
        why = f"its ranks are on {len(hosts)} hosts" if len(hosts) > 1 else f"{SHM_DIR} is missing or too small"
        if rank == 0:
            logger.log(logging.INFO, f"group {name!r}: collectives over TCP, not shared memory: {why}")
        return None
    token = infos[0][1]
    safe = "".join(c if c.isalnum() else "_" for c in name)
    paths = [os.path.join(SHM_DIR, f"deepshard-{token}-{safe}-{r}") for r in range(size)]
    own = _create(paths[rank], nbytes)
    created = _gather(own is not None, group, size)
    maps = [own if r == rank else (_open(p, nbytes) if all(created) else None) for r, p in enumerate(paths)]
    mapped = _gather(all(m is not None for m in maps), group, size)  # also the barrier before unlinking
    if own is not None:
        os.unlink(paths[rank])
    if not all(mapped):
        if rank == 0:
            logger.log(logging.WARNING, f"group {name!r}: shared memory outboxes could not be created or "
                                        f"mapped in {SHM_DIR}; collectives stay on TCP")
        return None
    return ShmRing([m for m in maps if m is not None], rank, peers, slot_bytes, limit, paths)
