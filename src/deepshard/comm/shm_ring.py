"""The mapped outboxes of a shared-memory group and the round protocol over them (``ShmRing``): the data
path of ``comm/shm.py``'s transport, which documents the design (outboxes, slots, signals, rendezvous)."""
from __future__ import annotations

import contextlib
import mmap
import os
import time
from typing import Iterator, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

from deepshard.comm.pairwise import piece_ranges
from deepshard.comm.tree_sum import OwnChunk, tree_sum
from deepshard.utils.hugepages import advise_huge_pages

HEADER_BYTES = 4096
_WRITTEN, _READ, _PRINT = 0, 1, 2  # header words: last written round, last fully read round, fingerprints
_YIELDS = 200  # waits first yield the core this many times, then sleep
_SLEEP_S = 30e-6  # the first sleeps; later ones grow with the time already waited (see ShmRing._wait)
_MAX_SLEEP_S = 10e-3
_LATENESS = 0.05  # a sleep is at most this fraction of the time already waited: the wait ends <= 5% late
_LIVENESS_S = 0.25  # how often a long wait checks that the peers' processes still exist


class Late(Exception):
    """A wait passed its deadline: ``missing`` (global ranks) did not ``doing``."""

    def __init__(self, missing: list[int], doing: str) -> None:
        super().__init__(f"rank(s) {missing} did not {doing}")
        self.missing = missing


class ShmRing:
    """The mapped outboxes of one group (one per rank, index = group rank) and the round sequence.
    Built by :class:`ShmTransport`; every rank runs the same collectives in the same order."""

    def __init__(self, maps: list[mmap.mmap], rank: int, peers: list[int], pids: list[int],
                 slot_bytes: int) -> None:
        self.rank, self.size, self.peers, self.pids = rank, len(maps), peers, pids
        self.slot_bytes = slot_bytes
        self._maps = maps
        self._heads = [memoryview(m)[:HEADER_BYTES].cast("q") for m in maps]
        self._slots: list[torch.Tensor] = []  # the outboxes as tensors, during a collective only
        self._round = 0

    @contextlib.contextmanager
    def _outboxes(self) -> Iterator[None]:
        """Map the outboxes as tensors for one collective, with dispatch modes off: they are the transport's
        buffers, not tensor memory (a ``TensorMemoryTracker`` counts them no more than gloo's own)."""
        with _disable_current_modes():
            self._slots = [torch.frombuffer(m, dtype=torch.uint8, offset=HEADER_BYTES, count=2 * self.slot_bytes)
                           .view(2, self.slot_bytes) for m in self._maps]
            try:
                yield
            finally:
                self._slots = []

    # ------------------------------------------------------------------------------------ rounds
    def _write_begin(self, deadline: float) -> tuple[int, torch.Tensor]:
        """The next round number and this rank's free slot for it (once every peer read the round that
        used it last)."""
        t = self._round + 1
        self._wait(_READ, t - 2, deadline, "finish reading the previous round")
        return t, self._slots[self.rank][t % 2]

    def _publish(self, t: int, fingerprint: int) -> None:
        head = self._heads[self.rank]
        head[_PRINT + t % 2] = fingerprint
        head[_WRITTEN] = t  # x86 keeps stores in order: the data and fingerprint are visible first (hence
        # ORDERED_STORES: a weakly ordered CPU, e.g. ARM, would need a store fence before this line)

    def _await_peers(self, t: int, fingerprint: int, deadline: float, what: str) -> None:
        self._wait(_WRITTEN, t, deadline, "arrive")
        wrong = [self.peers[r] for r in range(self.size) if self._heads[r][_PRINT + t % 2] != fingerprint]
        if wrong:
            raise RuntimeError(f"shared-memory collective mismatch: rank(s) {wrong} issued a different collective "
                               f"(another kind, size or order) than {what}")

    def _read_done(self, t: int) -> None:
        self._heads[self.rank][_READ] = t
        self._round = t

    def _wait(self, word: int, target: int, deadline: float, doing: str) -> None:
        """Until every peer's header ``word`` reaches ``target``: yield the core, then sleep, checking now and
        then that the peers' processes exist. Raises :class:`Late` after ``deadline``.

        The sleeps grow with the time already waited (at most ``_LATENESS`` of it, at most ``_MAX_SLEEP_S``),
        and each poll reads one late peer's header, not the whole group's: a wait wakes up about 120 times in
        its first 0.2 s, then 100 times a second, whatever the group size. Polling every 30 us cost the
        waiting thread CPU in proportion to the wait (~45 ms of CPU for a 0.5 s wait on 2 cores), and on
        oversubscribed cores (more ranks than cores, each waiting for the others to be scheduled) waits
        grow with the rank count, and so did a pipeline rank's CPU per step."""
        heads = self._heads
        late = [r for r in range(self.size) if r != self.rank and heads[r][word] < target]
        spins, check_at, started = 0, 0.0, 0.0
        while late:
            if heads[late[-1]][word] >= target:  # the last late peer first; the rest once it has arrived
                late = [r for r in late if heads[r][word] < target]
                if not late:
                    return
            spins += 1
            if spins <= _YIELDS:
                os.sched_yield()
                continue
            now = time.monotonic()
            if not started:
                started = now
            if now > deadline:
                raise Late([self.peers[r] for r in late], f"{doing} (round {target})")
            if now > check_at:
                check_at = now + _LIVENESS_S
                self._check_alive(late)
            time.sleep(min(_MAX_SLEEP_S, max(_SLEEP_S, (now - started) * _LATENESS)))

    def _check_alive(self, ranks: list[int]) -> None:
        for r in ranks:
            if self.pids[r] > 0 and not _alive(self.pids[r]):
                raise RuntimeError(f"connection closed: rank {self.peers[r]} (process {self.pids[r]} on this host) "
                                   "exited while this rank waited for it over shared memory")

    # ------------------------------------------------------------------------------ collectives
    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, fingerprint: int, deadline: float,
                   what: str) -> None:
        """Concatenate every rank's ``shard`` into the contiguous ``output`` in rank order (``shard`` may be
        chunk ``rank`` of ``output``)."""
        chunks = output.reshape(self.size, -1)
        mine = shard.reshape(-1)
        if mine.data_ptr() != chunks[self.rank].data_ptr():
            chunks[self.rank].copy_(mine)
        if chunks.numel():
            with self._outboxes():
                self._gather_rounds(chunks.view(torch.uint8), fingerprint, deadline, what)

    def _gather_rounds(self, dest: torch.Tensor, fingerprint: int, deadline: float, what: str) -> None:
        src = dest[self.rank]
        for lo in range(0, src.numel(), self.slot_bytes):
            n = min(self.slot_bytes, src.numel() - lo)
            t, slot = self._write_begin(deadline)
            slot[:n].copy_(src[lo:lo + n])
            self._publish(t, fingerprint)
            self._await_peers(t, fingerprint, deadline, what)
            for k in range(1, self.size):
                r = (self.rank + k) % self.size
                dest[r, lo:lo + n].copy_(self._slots[r][t % 2][:n])
            self._read_done(t)

    def reduce_scatter(self, pieces: list[torch.Tensor], chunk: int, fingerprint: int, deadline: float,
                       what: str, output: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Chunk ``rank`` of the sum over the ranks of the concatenation of the 1-D ``pieces`` (zero-padded
        to ``N * chunk``): a fresh tensor, or ``output`` (which may be that chunk of the only piece). Same
        summation order and 16-bit handling as ``pairwise.reduce_scatter_pieces``."""
        numels = [p.numel() for p in pieces]
        dtype = pieces[0].dtype
        wide = self.size > 2 and dtype.itemsize < 4  # summed in fp32, rounded once
        direct = output is not None and not wide
        acc = output.reshape(-1) if direct else torch.empty(chunk, dtype=torch.float32 if wide else dtype)
        if not direct:
            advise_huge_pages(acc)
        per_round = self.slot_bytes // ((self.size - 1) * dtype.itemsize)
        temps: list[torch.Tensor] = []
        with self._outboxes():
            for lo in range(0, chunk, per_round):
                n = min(per_round, chunk - lo)
                t, slot = self._write_begin(deadline)
                self._fill(slot, pieces, numels, chunk, lo, n, per_round)
                self._publish(t, fingerprint)
                self._await_peers(t, fingerprint, deadline, what)
                self._sum(acc[lo:lo + n], t, pieces, numels, chunk, lo, per_round, wide, temps)
                self._read_done(t)
        if output is not None:
            return output if direct else output.copy_(acc.reshape(output.shape))
        return acc.to(dtype) if wide else acc

    def _block(self, r: int, t: int, k: int, n: int, per_round: int, dtype: torch.dtype) -> torch.Tensor:
        """Block ``k - 1`` of rank ``r``'s slot of round ``t``: what ``r`` sends to rank ``r + k``."""
        start = (k - 1) * per_round * dtype.itemsize
        return self._slots[r][t % 2][start:start + n * dtype.itemsize].view(dtype)

    def _fill(self, slot: torch.Tensor, pieces: list[torch.Tensor], numels: list[int], chunk: int,
              lo: int, n: int, per_round: int) -> None:
        """Write elements ``[lo, lo + n)`` of every other rank's chunk into this round's blocks (zeros where
        the pieces end)."""
        dtype = pieces[0].dtype
        for k in range(1, self.size):
            dst = (self.rank + k) % self.size
            start = (k - 1) * per_round * dtype.itemsize
            block = slot[start:start + n * dtype.itemsize].view(dtype)
            at = 0
            for i, off, m in piece_ranges(numels, dst * chunk + lo, dst * chunk + lo + n):
                block[at:at + m].copy_(pieces[i][off:off + m])
                at += m
            if at < n:
                block[at:].zero_()

    def _sum(self, acc: torch.Tensor, t: int, pieces: list[torch.Tensor], numels: list[int], chunk: int,
             lo: int, per_round: int, wide: bool, temps: list[torch.Tensor]) -> None:
        """``acc`` = the canonical sum (``tree_sum.py``) of the blocks from the other ranks and this rank's own
        elements. ``acc`` may be this rank's own elements (in-place reduce-scatter): the sum is taken in
        ``temps`` (reused across rounds) and copied in at the end."""
        n, dtype = acc.numel(), pieces[0].dtype
        own, at = [], 0
        begin = self.rank * chunk + lo
        for i, off, m in piece_ranges(numels, begin, begin + n):
            own.append((at, pieces[i][off:off + m]))
            at += m
        free = list(temps)

        def temp() -> torch.Tensor:
            if not free:
                temps.append(torch.empty(per_round, dtype=torch.float32 if wide else dtype))
                free.append(temps[-1])
            return free.pop()[:n]

        def block(r: int) -> torch.Tensor:
            return self._block(r, t, (self.rank - r) % self.size, n, per_round, dtype)

        result = tree_sum(self.size, self.rank, block, OwnChunk(own), False, temp, lambda x: None)
        acc.copy_(result)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` (on this host) exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return not os.path.isdir("/proc/self")  # no procfs: cannot tell, assume alive
    return state not in (b"Z", b"X")
