"""Where ZeRO-3 keeps this rank's parameter shard between uses.

The shard is one flat tensor in shard space (the rank's chunk of every parameter group, end to end).
Each :class:`~deepshard.zero.stage3.group.ShardedGroup` reaches its chunk through a *shard source*
with four operations: ``prefetch`` (start bringing it in), ``acquire`` (the chunk on the compute
device, waiting if needed; what the all-gather sends), ``release`` (done with it until next time) and
``write`` (new values, from an optimizer step, a checkpoint or ``GatheredParameters``).

- :class:`ResidentParamStore`: the shard stays in device memory; sources are views, every operation
  but ``write`` is free. ZeRO-3 without parameter offload.
- :class:`OffloadedParamStore`: the shard lives in a backing (swap file, or pinned host memory on
  CUDA); a source reads its chunk into a fresh tensor on ``prefetch`` / ``acquire`` and drops it on
  ``release``, so only the chunks of the groups being gathered are resident. Where the backing keeps
  the shard in memory it can address (host memory, a swap file mapped into memory) the source uses
  its view instead, and ``release`` lets a mapping's pages go (``Backing.settle``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from deepshard.utils.hugepages import advise_huge_pages
from deepshard.zero.offload.backing import Backing
from deepshard.zero.offload.buffers import BufferPool
from deepshard.zero.offload.mapped import MappedFileBacking
from deepshard.zero.offload.swapper import IOOp

PARAMS = "params"
STAGED_WRITE_BYTES = 16 << 20  # writes up to this size (a default sub-group) are copied into two reused buffers


class ShardSource(ABC):
    """One group's chunk of the shard (see the module docstring)."""

    numel: int
    dtype: torch.dtype

    def prefetch(self) -> None:
        """Start bringing the chunk in (no-op when it is resident)."""

    @abstractmethod
    def acquire(self) -> torch.Tensor:
        """The chunk on the compute device; valid until ``release``."""

    def release(self) -> None:
        """The caller is done with the tensor ``acquire`` returned."""

    @abstractmethod
    def write(self, values: torch.Tensor) -> None:
        """Replace the chunk's values (cast to the shard dtype); done when this returns."""

    def read_copy(self) -> torch.Tensor:
        """A private copy of the chunk."""
        value = self.acquire().clone()
        self.release()
        return value


class ParamStore(ABC):
    """This rank's parameter shard (``numel`` elements of ``dtype``)."""

    numel: int
    dtype: torch.dtype
    resident: bool = False  # True: the shard is in device memory and ``view`` gives slices of it

    @abstractmethod
    def source(self, start: int, numel: int) -> ShardSource:
        """The source of shard range ``[start, start + numel)``."""

    @abstractmethod
    def write(self, start: int, values: torch.Tensor) -> None:
        """Start replacing shard range ``[start, start + values.numel())``; ``flush`` finishes it."""

    def flush(self) -> None:
        """Finish every outstanding write."""

    def view(self, start: int, numel: int) -> torch.Tensor | None:
        """A view of the range when the shard is resident on the compute device, else None."""
        return None

    def host_view(self, start: int, numel: int) -> torch.Tensor | None:
        """A view of the range wherever it is addressable (device or host memory, a file mapped into
        memory), else None (a swap file read on demand). Writes through it change the shard."""
        return self.view(start, numel)

    def fp32_file(self) -> tuple[Backing, str] | None:
        """``(backing, name)`` when the shard is fp32 in a swap file mapped into memory: the optimizer's
        offloaded states can use it as their master weights (``StatesSpec.shared_masters``)."""
        return None

    @abstractmethod
    def memory(self) -> dict[str, int]:
        """``parameters`` (resident bytes) and ``offloaded`` bytes."""

    def close(self) -> None:
        """Release files and memory."""


class _ResidentSource(ShardSource):
    def __init__(self, view: torch.Tensor) -> None:
        self.view, self.numel, self.dtype = view, view.numel(), view.dtype

    def acquire(self) -> torch.Tensor:
        return self.view

    @torch.no_grad()
    def write(self, values: torch.Tensor) -> None:
        self.view.copy_(values.reshape(-1))


class ResidentParamStore(ParamStore):
    """The shard in device memory."""

    resident = True

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel, self.dtype = numel, dtype
        self.flat = torch.zeros(numel, dtype=dtype, device=device)

    def source(self, start: int, numel: int) -> ShardSource:
        return _ResidentSource(self.flat[start:start + numel])

    def view(self, start: int, numel: int) -> torch.Tensor | None:
        return self.flat[start:start + numel]

    @torch.no_grad()
    def write(self, start: int, values: torch.Tensor) -> None:
        self.flat[start:start + values.numel()].copy_(values.reshape(-1))

    def memory(self) -> dict[str, int]:
        return {"parameters": self.flat.numel() * self.flat.element_size(), "offloaded": 0}


class _OffloadedSource(ShardSource):
    def __init__(self, store: "OffloadedParamStore", start: int, numel: int) -> None:
        self.store, self.start, self.numel, self.dtype = store, start, numel, store.dtype
        self._host: torch.Tensor | None = None
        self._read: IOOp | None = None
        self._version = -1  # the store's write count when _host was read
        self._viewed = False  # _host is the backing's own memory (a view), not a copy

    def prefetch(self) -> None:
        if self._host is not None and self._version == self.store.version:
            return
        self.release()  # (a stale copy: the shard was written since it was read)
        self._version = self.store.version
        backing = self.store.backing
        view = backing.view(PARAMS, self.start, self.numel)
        if view is not None:
            self._host, self._viewed = view, True
            backing.prefetch(PARAMS, self.start, self.numel)
            return
        self.store.flush()  # never read bytes a pending write is still changing
        self._host = torch.empty(self.numel, dtype=self.dtype, pin_memory=self.store.pin)
        if not self.store.pin:
            advise_huge_pages(self._host)  # a fresh chunk every gather: fault it in 2 MiB at a time
        self._read = backing.read(PARAMS, self.start, self._host)

    def acquire(self) -> torch.Tensor:
        self.prefetch()
        if self._read is not None:
            self._read.wait()
            self._read = None
        return self._host.to(self.store.device, non_blocking=True)  # type: ignore[union-attr]

    def release(self) -> None:
        if self._read is not None:
            self._read.wait()
        if self._viewed:
            self.store.backing.settle(PARAMS, self.start, self.numel)
        self._host, self._read, self._viewed = None, None, False

    @torch.no_grad()
    def write(self, values: torch.Tensor) -> None:
        self.release()
        self.store.write(self.start, values)
        self.store.flush()


class OffloadedParamStore(ParamStore):
    """The shard in a backing: a swap file (NVMe) or pinned host memory (CPU offload on CUDA)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, backing: Backing, pin: bool) -> None:
        self.numel, self.dtype, self.device, self.pin = numel, dtype, device, pin
        self.backing = backing
        self.version = 0  # counts writes, so sources can tell a prefetched copy went stale
        self._staging: BufferPool | None = None  # sized to the largest write up to STAGED_WRITE_BYTES
        backing.create(PARAMS, dtype, numel)

    def source(self, start: int, numel: int) -> ShardSource:
        return _OffloadedSource(self, start, numel)

    def host_view(self, start: int, numel: int) -> torch.Tensor | None:
        return self.backing.view(PARAMS, start, numel)

    def fp32_file(self) -> tuple[Backing, str] | None:
        mapped = isinstance(self.backing, MappedFileBacking)
        return (self.backing, PARAMS) if mapped and self.dtype == torch.float32 else None

    @torch.no_grad()
    def write(self, start: int, values: torch.Tensor) -> None:
        # a private copy in the shard dtype: the write completes in the background. The optimizer
        # publishes one sub-group at a time, so two reused buffers of that size hold the copies (fresh
        # memory for every sub-group would fault in page by page); a larger write gets its own tensor.
        self.version += 1
        values = values.detach().reshape(-1)
        if self.backing.in_place:  # memory the backing owns: one copy, done when this returns
            self.backing.write(PARAMS, start, values.to("cpu", self.dtype))
            return
        nbytes = values.numel() * self.dtype.itemsize
        if nbytes <= STAGED_WRITE_BYTES and (self._staging is None or nbytes > self._staging.nbytes):
            self._staging = BufferPool(2, nbytes, self.pin, "offload_param")  # (buffers in flight go with the old)
        if self._staging is None or nbytes > self._staging.nbytes:
            self.backing.write(PARAMS, start, values.to("cpu", self.dtype, copy=True))
            return
        buffer = self._staging.acquire(1)
        copy = buffer[0][:nbytes].view(self.dtype)  # type: ignore[index]
        copy.copy_(values)
        self._staging.release_after(buffer, [self.backing.write(PARAMS, start, copy)])  # type: ignore[arg-type]

    def flush(self) -> None:
        self.backing.flush()

    def memory(self) -> dict[str, int]:
        return {"parameters": 0, "offloaded": self.backing.nbytes()}

    def close(self) -> None:
        self.backing.close()
        if self._staging is not None:
            self._staging.clear()
