"""Where offloaded shard-sized tensors are kept: host memory or swap files.

A backing holds named 1-D tensors in shard space (``master``, ``state.exp_avg``, ``params`` ...) and
moves ranges of them in and out. Host memory can hand out views directly (``view``), so nothing is
copied; files cannot, so ranges are read into and written from staging buffers asynchronously.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from deepshard.zero.offload.swapper import AsyncSwapper, CompletedOp, IOOp


class Backing(ABC):
    """Named shard-space tensors off the compute device."""

    in_place = False  # True: ``view`` gives every range and ``read`` / ``write`` are done when they return

    def __init__(self) -> None:
        self.dtypes: dict[str, torch.dtype] = {}
        self.numels: dict[str, int] = {}

    def has(self, name: str) -> bool:
        return name in self.dtypes

    def create(self, name: str, dtype: torch.dtype, numel: int) -> None:
        self.dtypes[name], self.numels[name] = dtype, numel
        self._create(name, dtype, numel)

    @abstractmethod
    def _create(self, name: str, dtype: torch.dtype, numel: int) -> None: ...

    @abstractmethod
    def view(self, name: str, start: int, numel: int) -> torch.Tensor | None:
        """A view of the range where the data lives in memory, or None (then use ``read``)."""

    @abstractmethod
    def read(self, name: str, start: int, into: torch.Tensor) -> IOOp:
        """Start copying ``[start, start + into.numel())`` of ``name`` into ``into``."""

    @abstractmethod
    def write(self, name: str, start: int, src: torch.Tensor) -> IOOp:
        """Start copying ``src`` to ``[start, start + src.numel())`` of ``name``."""

    def nbytes(self) -> int:
        return sum(n * torch.empty(0, dtype=self.dtypes[k]).element_size() for k, n in self.numels.items())

    def read_copy(self, name: str, start: int, numel: int) -> torch.Tensor:
        """A fresh tensor with the range's values (waits)."""
        out = torch.empty(numel, dtype=self.dtypes[name])
        self.read(name, start, out).wait()
        return out

    def flush(self) -> None:
        """Wait for every outstanding write."""

    def prefetch(self, name: str, start: int, numel: int) -> None:
        """A view of the range will be used soon: start bringing it into memory (no-op by default)."""

    def settle(self, name: str, start: int, numel: int) -> None:
        """The caller is done with its views of the range for now: a backing that maps files into
        memory lets go of their pages (values kept). No-op by default."""

    def discard(self, name: str) -> None:
        """The values of ``name`` are dead until next written: storage may drop them (reads give zeros or
        the old values). Call it with no read or write of ``name`` in flight."""

    def close(self) -> None:
        """Free the storage."""


class HostBacking(Backing):
    """Tensors in (pinned) host memory: the CPU-offload case."""

    in_place = True

    def __init__(self, pin: bool) -> None:
        super().__init__()
        self.pin = pin
        self.tensors: dict[str, torch.Tensor] = {}

    def _create(self, name: str, dtype: torch.dtype, numel: int) -> None:
        self.tensors[name] = torch.zeros(numel, dtype=dtype, pin_memory=self.pin)

    def view(self, name: str, start: int, numel: int) -> torch.Tensor | None:
        return self.tensors[name][start:start + numel]

    def read(self, name: str, start: int, into: torch.Tensor) -> IOOp:
        into.copy_(self.tensors[name][start:start + into.numel()])
        return CompletedOp()

    def write(self, name: str, start: int, src: torch.Tensor) -> IOOp:
        self.tensors[name][start:start + src.numel()].copy_(src.reshape(-1))
        return CompletedOp()

    def close(self) -> None:
        self.tensors.clear()


class FileBacking(Backing):
    """Tensors in swap files (one file per name) through an :class:`AsyncSwapper`."""

    def __init__(self, swapper: AsyncSwapper) -> None:
        super().__init__()
        self.swapper = swapper
        self._writes: list[IOOp] = []

    def _create(self, name: str, dtype: torch.dtype, numel: int) -> None:
        self.swapper.create(name, numel * torch.empty(0, dtype=dtype).element_size())

    def _offset(self, name: str, start: int, numel: int) -> int:
        if start < 0 or start + numel > self.numels[name]:
            raise ValueError(f"range [{start}, {start + numel}) is outside swap tensor {name!r} "
                             f"({self.numels[name]} elements)")
        return start * torch.empty(0, dtype=self.dtypes[name]).element_size()

    def view(self, name: str, start: int, numel: int) -> torch.Tensor | None:
        return None

    def read(self, name: str, start: int, into: torch.Tensor) -> IOOp:
        self._check(name, into)
        return self.swapper.read(name, self._offset(name, start, into.numel()), into)

    def write(self, name: str, start: int, src: torch.Tensor) -> IOOp:
        self._check(name, src)
        op = self.swapper.write(name, self._offset(name, start, src.numel()), src.contiguous())
        self._writes = [w for w in self._writes if not w.done()] + [op]
        return op

    def _check(self, name: str, t: torch.Tensor) -> None:
        if t.dtype != self.dtypes[name]:
            raise TypeError(f"swap tensor {name!r} holds {self.dtypes[name]}, got a {t.dtype} tensor")

    def flush(self) -> None:
        writes, self._writes = self._writes, []
        for op in writes:
            op.wait()

    def discard(self, name: str) -> None:
        self.swapper.discard(name)

    def close(self) -> None:
        self.swapper.close()
