"""Swap files used in place: each file mapped into memory (``MAP_SHARED``), its ranges handed out as
tensor views.

The staged path (:class:`~deepshard.zero.offload.backing.FileBacking`) copies every byte twice per
use: ``pread`` from the page cache into a staging buffer, ``pwrite`` from the buffer back. A mapped
file needs neither: the optimizer updates its states in the page cache's own pages, a parameter
gather sends straight from them. The kernel still owns the pages: dirty ones are written to the disk
in the background, clean ones are evicted under memory pressure and read again on the next touch,
exactly as for the staged path's files. What a process holds mapped counts in its resident memory,
so a caller ``settle``\\ s each range once it is done with it: the range is unmapped from the process
(``MADV_DONTNEED``, which on a shared file mapping keeps every value and every dirty page in the page
cache) and resident memory stays bounded by what is in use at once, as with staging buffers.
``prefetch`` asks the kernel to read a range ahead (``MADV_WILLNEED``) so that a range evicted from
the page cache is read from the disk while the previous one is computed on; ``populate`` maps a range
about to be used in one call (``MADV_POPULATE_READ`` / ``_WRITE``) rather than fault by fault.

Files are reserved in full when created (``posix_fallocate``, by the swapper), so a page written
through the mapping never needs a new disk block (a full disk would otherwise kill the process with
``SIGBUS`` instead of raising); for the same reason no hole is ever punched in a mapped file
(``discard`` keeps the values).
"""
from __future__ import annotations

import mmap

import torch

from deepshard.zero.offload.backing import FileBacking
from deepshard.zero.offload.swapper import AsyncSwapper, CompletedOp, IOOp

MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class MappedFileBacking(FileBacking):
    """Swap files mapped into memory; see the module docstring."""

    in_place = True

    def __init__(self, swapper: AsyncSwapper) -> None:
        super().__init__(swapper)
        self._maps: dict[str, mmap.mmap] = {}
        self._flat: dict[str, torch.Tensor] = {}
        self._page = mmap.PAGESIZE

    def _create(self, name: str, dtype: torch.dtype, numel: int) -> None:
        super()._create(name, dtype, numel)
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            self._flat[name] = torch.empty(0, dtype=dtype)
            return
        m = mmap.mmap(self.swapper.fileno(name), nbytes, flags=mmap.MAP_SHARED,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._maps[name] = m
        self._flat[name] = torch.frombuffer(m, dtype=torch.uint8).view(dtype)

    def view(self, name: str, start: int, numel: int) -> torch.Tensor:
        self._offset(name, start, numel)  # (checks the range)
        return self._flat[name][start:start + numel]

    def read(self, name: str, start: int, into: torch.Tensor) -> IOOp:
        self._check(name, into)
        into.copy_(self.view(name, start, into.numel()))
        self.settle(name, start, into.numel())
        return CompletedOp()

    def write(self, name: str, start: int, src: torch.Tensor) -> IOOp:
        self._check(name, src)
        self.view(name, start, src.numel()).copy_(src.reshape(-1))
        self.settle(name, start, src.numel())
        return CompletedOp()

    def _advise(self, name: str, start: int, numel: int, advice: int) -> None:
        m = self._maps.get(name)
        if m is None or numel <= 0:
            return
        size = self.dtypes[name].itemsize
        lo = (start * size) // self._page * self._page
        hi = min(-(-((start + numel) * size) // self._page) * self._page, len(m))
        m.madvise(advice, lo, hi - lo)

    def settle(self, name: str, start: int, numel: int) -> None:
        # whole pages around the range: unmapping a neighbour's page loses nothing (it stays cached)
        self._advise(name, start, numel, MADV_DONTNEED)

    def prefetch(self, name: str, start: int, numel: int) -> None:
        self._advise(name, start, numel, MADV_WILLNEED)

    def populate(self, name: str, start: int, numel: int, write: bool) -> None:
        # one system call maps the whole range (writable: the file system's per-page preparation too)
        # instead of one page fault per page (or per 16 pages) as the computation touches it
        try:
            self._advise(name, start, numel, MADV_POPULATE_WRITE if write else MADV_POPULATE_READ)
        except OSError:  # a kernel before 5.14: the pages fault in one by one instead
            pass

    def discard(self, name: str) -> None:
        """Keeps the pages (a no-op): dropping them saves their write-back, but the next use then faults
        fresh pages into the page cache, and that measured slower than letting the kernel write them
        in the background (403M fp32 ZeRO-3: 0.5 s per step, see docs/offload.md)."""

    def flush(self) -> None:
        """Nothing is in flight: every copy in and out of a mapping is done when it returns."""

    def close(self) -> None:
        self._flat.clear()
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a view is still referenced somewhere: the mapping goes with it
                pass
        self._maps.clear()
        super().close()
