"""How a group's data moves: one :class:`Transport` per ``CommGroup``, chosen once when the group is made
(:func:`choose_transport`), behind one interface.

- :class:`NativeTransport`: torch's own collectives (NCCL, or gloo when asked).
- :class:`PairwiseTransport`: reduce-scatter, all-gather, all-to-all and small all-reduces as direct
  ``isend``/``irecv`` exchanges over the backend's TCP connections (``comm/pairwise.py``): on gloo its
  native collectives are 2-3x slower and copy the whole input. Tensors off the host go to torch's own.
- :class:`SharedMemoryTransport`: the pairwise forms, with all-gather and reduce-scatter through shared
  memory when every rank of the group is on this host (``comm/shm.py``); its rendezvous runs at the
  group's first such collective and settles shared memory or TCP for the group's life.

``CommGroup`` counts bytes and waits under the watchdog; a transport only starts the exchange and returns
its handle. Tags (``tag(key, nbytes, count)``) are taken from the group's one sequence, in the same order
on every rank, only by transports that send tagged messages.
"""
from __future__ import annotations

import zlib
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

import deepshard.comm.pairwise as pairwise
from deepshard.comm.shm import ShmTransport
from deepshard.comm.watchdog import WaitLimit

TagFn = Callable[..., int]
"""``tag(key, nbytes, count=1)``: the group's next tag (``CommGroup._next_tag``)."""

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def padded_concat(pieces: list[torch.Tensor], numel: int) -> torch.Tensor:
    """The 1-D ``pieces`` end to end in a fresh zero-padded tensor of ``numel`` elements."""
    flat = torch.zeros(numel, dtype=pieces[0].dtype, device=pieces[0].device)
    torch.cat(pieces, out=flat[:sum(p.numel() for p in pieces)])
    return flat


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class NativeTransport:
    """torch's collectives on the group's process group."""

    kind = "native"

    def __init__(self, group: Optional[dist.ProcessGroup], backend: str) -> None:
        self.group, self.backend = group, backend

    def pairwise_for(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` goes through the pairwise forms (whose result may land in their own input)."""
        return False

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, key: int, what: str) -> Any:
        return _all_gather(output, shard, group=self.group, async_op=True)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, what: str) -> Any:
        return _reduce_scatter(output, full, group=self.group, async_op=True)

    def reduce_scatter_pieces(self, pieces: list[torch.Tensor], chunk: int, size: int, key: int, what: str) -> Any:
        """The pieces copied into one staging buffer for the native collective; ``result`` is the chunk."""
        staging = padded_concat(pieces, chunk * size)
        out = torch.empty(chunk, dtype=pieces[0].dtype, device=pieces[0].device)
        native = _reduce_scatter(out, staging, group=self.group, async_op=True)
        return pairwise.CollectiveWork([native], lambda: out,
                                       scratch_bytes=(staging.numel() + out.numel()) * out.element_size())

    def all_to_all(self, output: torch.Tensor, data: torch.Tensor, what: str) -> Any:
        return dist.all_to_all_single(output, data, group=self.group, async_op=True)

    def all_reduce_small(self, tensor: torch.Tensor, op: str, what: str) -> Any:
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        return dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=True)


class PairwiseTransport(NativeTransport):
    """Direct tagged exchanges between the group's ranks for host tensors (see the module docstring)."""

    kind = "pairwise"

    def __init__(self, group: Optional[dist.ProcessGroup], backend: str, rank: int, peers: list[int],
                 tag: TagFn) -> None:
        super().__init__(group, backend)
        self.rank, self.peers, self.tag = rank, peers, tag

    def pairwise_for(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"  # gloo's point-to-point ops take host tensors

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, key: int, what: str) -> Any:
        if not self.pairwise_for(output):
            return super().all_gather(output, shard, key, what)
        tag = self.tag(key, _nbytes(output))
        return pairwise.all_gather(output, shard, self.rank, self.peers, self.group, tag)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, what: str) -> Any:
        if not self.pairwise_for(full):
            return super().reduce_scatter(output, full, what)
        tag = self.tag(0, _nbytes(full))
        return pairwise.reduce_scatter(output, full, self.rank, self.peers, self.group, tag)

    def reduce_scatter_pieces(self, pieces: list[torch.Tensor], chunk: int, size: int, key: int, what: str) -> Any:
        if not self.pairwise_for(pieces[0]):
            return super().reduce_scatter_pieces(pieces, chunk, size, key, what)
        tag = self.tag(key, sum(p.numel() for p in pieces) * pieces[0].element_size(), count=len(pieces))
        return pairwise.reduce_scatter_pieces(pieces, chunk, self.rank, self.peers, self.group, tag)

    def all_to_all(self, output: torch.Tensor, data: torch.Tensor, what: str) -> Any:
        if not self.pairwise_for(data):
            return super().all_to_all(output, data, what)
        tag = self.tag(0, _nbytes(data))
        return pairwise.all_to_all(output, data, self.rank, self.peers, self.group, tag)

    def all_reduce_small(self, tensor: torch.Tensor, op: str, what: str) -> Any:
        if not self.pairwise_for(tensor):
            return super().all_reduce_small(tensor, op, what)
        tag = self.tag(zlib.crc32(op.encode()) + 1, _nbytes(tensor))
        return pairwise.all_reduce_small(tensor, op, self.rank, self.peers, self.group, tag)


class SharedMemoryTransport(PairwiseTransport):
    """The pairwise forms with all-gather and reduce-scatter over shared memory on one host (see the module
    docstring); ``link`` is the group's ``ShmTransport`` once its first such collective was issued."""

    kind = "shm"

    def __init__(self, group: Optional[dist.ProcessGroup], backend: str, rank: int, peers: list[int],
                 tag: TagFn, name: str, slot_bytes: Callable[[], int], limit: Callable[[], WaitLimit]) -> None:
        super().__init__(group, backend, rank, peers, tag)
        self.name, self._slot_bytes, self._limit = name, slot_bytes, limit
        self.link: Optional[ShmTransport] = None

    def _shm(self) -> Optional[ShmTransport]:
        """The shared-memory link, made at the first call (its rendezvous' three tags are taken then, at
        the same collective on every rank); None once the rendezvous kept the group on TCP."""
        if self.link is None:
            tags = [self.tag(-1 - i, 8 * len(self.peers)) for i in range(3)]
            self.link = ShmTransport(self.group, self.rank, self.peers, self.name, self._slot_bytes(),
                                     self._limit(), tags)
        return self.link if self.link.queues else None

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, key: int, what: str) -> Any:
        link = self._shm() if self.pairwise_for(output) else None
        if link is None:
            return super().all_gather(output, shard, key, what)
        return link.all_gather(output, shard, self.tag(key, _nbytes(output)), what)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, what: str) -> Any:
        link = self._shm() if self.pairwise_for(full) else None
        if link is None:
            return super().reduce_scatter(output, full, what)
        return link.reduce_scatter_tensor(output, full, self.tag(0, _nbytes(full)), what)

    def reduce_scatter_pieces(self, pieces: list[torch.Tensor], chunk: int, size: int, key: int, what: str) -> Any:
        link = self._shm() if self.pairwise_for(pieces[0]) else None
        if link is None:
            return super().reduce_scatter_pieces(pieces, chunk, size, key, what)
        nbytes = sum(p.numel() for p in pieces) * pieces[0].element_size()
        return link.reduce_scatter_pieces(pieces, chunk, self.tag(key, nbytes, count=len(pieces)), what)

    def all_reduce_small(self, tensor: torch.Tensor, op: str, what: str) -> Any:
        """An all-gather of every rank's copy through shared memory, combined here in rank order (the same
        bits as the TCP form): microseconds instead of a TCP round."""
        link = self._shm() if self.pairwise_for(tensor) else None
        if link is None:
            return super().all_reduce_small(tensor, op, what)
        if not tensor.is_contiguous():
            raise ValueError("all_reduce_control: the tensor must be contiguous")
        flat = tensor.reshape(-1)
        size = len(self.peers)
        copies = torch.empty((size, flat.numel()), dtype=flat.dtype, device=flat.device)
        work = link.all_gather(copies, flat.clone(), self.tag(zlib.crc32(op.encode()) + 1, _nbytes(tensor)), what)

        def finish() -> torch.Tensor:
            pairwise.combine_into(flat, copies, op)
            return tensor

        return pairwise.CollectiveWork([work], finish)


Transport = NativeTransport | PairwiseTransport | SharedMemoryTransport


def choose_transport(group: Optional[dist.ProcessGroup], backend: str, rank: int, peers: list[int], pairwise_on: bool,
                     shm_on: bool, tag: TagFn, name: str, slot_bytes: Callable[[], int], limit: Callable[[], WaitLimit]
                     ) -> Transport:
    """The group's transport, once: shared memory where wanted on gloo's pairwise forms, else the pairwise
    forms where wanted, else torch's own. ``slot_bytes`` and ``limit`` are read at the shared-memory
    rendezvous (the group's first such collective), as the settings they come from."""
    if pairwise_on and shm_on and backend == "gloo":
        return SharedMemoryTransport(group, backend, rank, peers, tag, name, slot_bytes, limit)
    if pairwise_on:
        return PairwiseTransport(group, backend, rank, peers, tag)
    return NativeTransport(group, backend)
