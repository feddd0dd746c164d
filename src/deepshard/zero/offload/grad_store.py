"""Where ZeRO-3 keeps this rank's reduced gradient shard between backward and the optimizer step.

- :class:`ResidentGradShard`: one tensor on the compute device (ZeRO-3 without disk offload).
- :class:`OffloadedGradShard`: the shard in the optimizer's swap backing, next to the master weights
  and optimizer states (ZeRO-Infinity). Each group's reduced chunk is written as soon as its
  reduce-scatter is done (added to what earlier micro-batches left there, when accumulating); the norm
  reads it back in the same chunks the resident norm uses, so both give the same bits; the optimizer
  reads each piece's gradient when its sub-group is updated. When the backing maps the file into
  memory, chunks are added to and read from the mapping in place (same arithmetic, same bits). Nothing shard-sized stays in memory: in
  fp32 training that is 4Ψ/N bytes, the largest resident tensor of an offloaded step.

Ranges are the gradient groups' chunks (``ranges``): every backward writes each of them once, and a
range not written since ``zero_`` reads as zeros.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch

from deepshard.zero.offload.backing import Backing
from deepshard.zero.offload.swapper import IOOp

GRADS = "grads"


class ResidentGradShard:
    """The gradient shard as one device tensor."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.tensor = torch.zeros(numel, dtype=dtype, device=device)

    def accumulate(self, start: int, values: torch.Tensor, alpha: float) -> None:
        """Add ``alpha * values`` to the range at ``start``."""
        self.tensor[start:start + values.numel()].add_(values, alpha=alpha)

    @torch.no_grad()
    def write(self, start: int, values: torch.Tensor) -> None:
        """Replace the range at ``start`` (``deepshard.utils.safe_set_*_grad``)."""
        self.tensor[start:start + values.numel()].copy_(values.reshape(-1))

    def pieces(self, spans: list[tuple[int, int]]) -> Sequence[torch.Tensor]:
        """Views of the ``(start, numel)`` ranges."""
        return [self.tensor[s:s + n] for s, n in spans]

    def norm_sources(self) -> Iterator[torch.Tensor]:
        """What the gradient norm is taken over."""
        yield self.tensor

    def zero_(self) -> None:
        self.tensor.zero_()

    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class OffloadedGradShard:
    """The gradient shard in ``backing`` (see the module docstring)."""

    def __init__(self, backing: Backing, numel: int, dtype: torch.dtype, device: torch.device,
                 ranges: Sequence[tuple[int, int]], norm_chunk: int) -> None:
        self.backing, self.numel, self.dtype, self.device = backing, numel, dtype, device
        self.ranges = [(s, n) for s, n in ranges if n > 0]
        self.norm_chunk = norm_chunk
        self.written: set[int] = set()
        self._pending: list[IOOp] = []
        backing.create(GRADS, dtype, numel)

    def _write(self, start: int, values: torch.Tensor) -> None:
        self._pending = [op for op in self._pending if not op.done()]
        self._pending.append(self.backing.write(GRADS, start, values))
        self.written.add(start)

    def _wait_writes(self) -> None:
        """Wait for this shard's own writes (not the optimizer's, which overlap the step)."""
        pending, self._pending = self._pending, []
        for op in pending:
            op.wait()

    @torch.no_grad()
    def accumulate(self, start: int, values: torch.Tensor, alpha: float) -> None:
        """Add ``alpha * values`` to the range at ``start``; the first time since ``zero_``, to zeros
        (the same arithmetic as the resident shard's ``add_``, so the same bits)."""
        values = values.to("cpu", self.dtype)
        view = self.backing.view(GRADS, start, values.numel())
        if view is not None:  # the file in memory (mapped): add in place
            self.backing.populate(GRADS, start, values.numel(), True)
            (view if start in self.written else view.zero_()).add_(values, alpha=alpha)
            self.written.add(start)
            self.backing.settle(GRADS, start, values.numel())
            return
        if start in self.written:
            self._wait_writes()
            base = self.backing.read_copy(GRADS, start, values.numel())
        else:
            base = torch.zeros(values.numel(), dtype=self.dtype)
        self._write(start, base.add_(values, alpha=alpha))

    def ready(self) -> None:
        """Zeros for the ranges no backward has written since ``zero_``; then wait for the writes (before
        anything reads the shard back)."""
        for start, numel in self.ranges:
            if start not in self.written:
                self._write(start, torch.zeros(numel, dtype=self.dtype))
        self._wait_writes()

    @torch.no_grad()
    def write(self, start: int, values: torch.Tensor) -> None:
        """Replace the range at ``start`` (``deepshard.utils.safe_set_*_grad``): every range is settled first
        (``ready``), so the write lands on what backward left and nothing later overwrites it with zeros."""
        self.ready()
        self.backing.write(GRADS, start, values.detach().reshape(-1).to("cpu", self.dtype, copy=True)).wait()

    def piece(self, start: int, numel: int) -> torch.Tensor:
        """A fresh copy of the range's gradient (read from the backing)."""
        self.ready()
        return self.backing.read_copy(GRADS, start, numel).to(self.device)

    def pieces(self, spans: list[tuple[int, int]]) -> Sequence[torch.Tensor]:
        """The ``(start, numel)`` ranges, each read when indexed."""
        return LazyPieces(self, spans)

    def norm_sources(self) -> Iterator[torch.Tensor]:
        """The shard in ``norm_chunk`` pieces (the chunks the resident norm squares, so the sum is the
        same), read one chunk ahead into two reused buffers: the next chunk's read overlaps the squaring
        of this one, and no fresh memory is touched per chunk. A yielded chunk is valid until the next."""
        self.ready()
        spans = [(lo, min(self.norm_chunk, self.numel - lo)) for lo in range(0, self.numel, self.norm_chunk)]
        if self.backing.in_place:  # the file in memory (mapped): the chunks in place
            for lo, n in spans:
                self.backing.prefetch(GRADS, lo + n, min(n, self.numel - lo - n))
                yield self.backing.view(GRADS, lo, n).to(self.device)  # type: ignore[union-attr]
                self.backing.settle(GRADS, lo, n)
            return
        buffers = [torch.empty(min(self.norm_chunk, self.numel), dtype=self.dtype) for _ in spans[:2]]

        def start(k: int) -> tuple[torch.Tensor, IOOp]:
            lo, n = spans[k]
            into = buffers[k % 2][:n]
            return into, self.backing.read(GRADS, lo, into)

        pending = start(0) if spans else None
        for k in range(len(spans)):
            chunk, op = pending  # type: ignore[misc]
            pending = start(k + 1) if k + 1 < len(spans) else None
            op.wait()
            yield chunk.to(self.device)

    def zero_(self) -> None:
        """Forget the gradients. A staged file's pages in the page cache are dropped unwritten
        (``discard``): most of its bytes would otherwise reach the disk after the step that consumed
        them, a fifth of an fp32 step's disk writes for nothing. A mapped file keeps its pages (see
        ``MappedFileBacking.discard``); either way the next backward starts from zeros (``written``)."""
        self._wait_writes()
        if self.written:
            self.backing.discard(GRADS)
        self.written.clear()

    def nbytes(self) -> int:
        return 0


class LazyPieces(Sequence[torch.Tensor]):
    """``pieces[i]``: piece ``i``'s gradient, read when asked for (the list-like the optimizer step and
    ``safe_get_full_grad`` index)."""

    def __init__(self, store: OffloadedGradShard, spans: list[tuple[int, int]]) -> None:
        self.store, self.spans = store, spans

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]
        start, numel = self.spans[i]
        return self.store.piece(start, numel)


GradShard = ResidentGradShard | OffloadedGradShard
