"""Gradient reduction for ZeRO stages 1 and 2, bucket by bucket, in the flat layout of ``partition.py``.

Both reducers launch buckets strictly in index order (as stage 0 does) so every rank issues the same
collectives in the same order, and both leave each rank the *average* of its chunk of every bucket.

* Stage 1 keeps a full gradient buffer (``.grad`` are views into it, accumulation is local) and, at the
  accumulation boundary, reduce-scatters each bucket as soon as backward has produced it, with at most
  ``max_in_flight`` buckets in flight (each holds the collective's scratch), back into its own chunk.
* Stage 2 keeps only this rank's shard of the gradient. Every backward copies each fresh ``.grad`` into
  its bucket's staging buffer (and frees it); a full bucket is reduce-scattered asynchronously and its
  chunk added into the shard. At most ``max_in_flight`` buckets are staged at once, so a process holds
  its gradient shard plus a few buckets, never the full gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepshard.comm.group import CommGroup
from deepshard.zero.partition import Bucket, FlatLayout


@dataclass
class _InFlight:
    bucket: Bucket
    work: Any
    out: torch.Tensor
    staging: torch.Tensor | None


class _OrderedLauncher:
    """Shared machinery: readiness per bucket, in-order launch, completion and scaling."""

    def __init__(self, layout: FlatLayout, params: list[torch.nn.Parameter], comm: CommGroup,
                 comm_dtype: torch.dtype | None, predivide: float, average: bool) -> None:
        self.layout, self.params, self.comm = layout, params, comm
        self.comm_dtype, self.predivide = comm_dtype, predivide
        self.post = (predivide / comm.size) if average else predivide
        self.slot_of = {id(params[s.param_index]): i for i, s in enumerate(layout.slots)}
        self.members: list[list[int]] = [[] for _ in layout.buckets]
        for i, s in enumerate(layout.slots):
            self.members[s.bucket].append(i)
        self.ready: list[set[int]] = [set() for _ in layout.buckets]
        self.next_launch = 0
        self.in_flight: list[_InFlight] = []
        self.active = False
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        raise NotImplementedError

    def _reduce_scatter(self, bucket: Bucket, full: torch.Tensor, staging: torch.Tensor | None,
                        into: torch.Tensor | None = None) -> None:
        """Start reduce-scattering ``full`` (the bucket's padded range) into a chunk-sized output:
        ``into`` itself where the backend can write a chunk of its own input (pairwise collectives)
        and no dtype conversion is needed, else a fresh tensor."""
        send = full if self.comm_dtype is None or self.comm_dtype == full.dtype else full.to(self.comm_dtype)
        if self.predivide != 1.0:
            send.div_(self.predivide)  # the staged/full buffer is rewritten or zeroed after the step
        if into is not None and self.comm.pairwise and send is full and into.dtype == send.dtype:
            out = into
        else:
            out = torch.empty(bucket.chunk, dtype=send.dtype, device=send.device)
        work = self.comm.reduce_scatter_tensor(out, send, async_op=True)
        self.in_flight.append(_InFlight(bucket, work, out, staging))

    def _finish(self, item: _InFlight, target: torch.Tensor, accumulate: bool) -> None:
        """Wait for ``item`` and write (or add) its averaged chunk into ``target``."""
        item.work.wait()
        if item.out.data_ptr() == target.data_ptr() and not accumulate:
            if self.post != 1.0:
                target.mul_(self.post)
            return
        chunk = item.out.to(target.dtype) if item.out.dtype != target.dtype else item.out
        if self.post != 1.0:
            chunk.mul_(self.post)
        if accumulate:
            target.add_(chunk)
        else:
            target.copy_(chunk)

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()


class Stage1Reducer(_OrderedLauncher):
    """Full local gradient buffer; reduce-scatter at the accumulation boundary."""

    def __init__(self, layout: FlatLayout, params: list[torch.nn.Parameter], comm: CommGroup, dtype: torch.dtype,
                 device: torch.device, comm_dtype: torch.dtype | None, predivide: float, average: bool,
                 max_in_flight: int = 2) -> None:
        super().__init__(layout, params, comm, comm_dtype, predivide, average)
        self.max_in_flight = max(1, max_in_flight)
        self.flat_grad = torch.zeros(layout.total, dtype=dtype, device=device)
        self.views = [self.flat_grad[s.flat_start:s.flat_start + s.numel].view(s.shape) for s in layout.slots]
        self._bind()
        # the reduced chunk of each bucket is written back into the owned range of the flat buffer
        self.shard_views = [self.flat_grad[lo:hi] for lo, hi, _ in layout.owned_ranges()]

    def _bind(self) -> None:
        for s_index, slot in enumerate(self.layout.slots):
            p, view = self.params[slot.param_index], self.views[s_index]
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view

    def begin_backward(self, reduce: bool) -> None:
        self._bind()
        self.active = reduce and self.comm.size > 1
        self.next_launch = 0
        for r in self.ready:
            r.clear()

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        s_index = self.slot_of[id(p)]
        view = self.views[s_index]
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view
        if not self.active:
            return
        self.ready[self.layout.slots[s_index].bucket].add(s_index)
        while self.next_launch < len(self.layout.buckets) and \
                len(self.ready[self.next_launch]) == len(self.members[self.next_launch]):
            self._launch(self.layout.buckets[self.next_launch])
            self.next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        while len(self.in_flight) >= self.max_in_flight:
            self._finish_oldest()
        lo, hi = bucket.owned(self.comm.rank)
        self._reduce_scatter(bucket, self.flat_grad[bucket.start:bucket.start + bucket.padded], None,
                             into=self.flat_grad[lo:hi])

    def _finish_oldest(self) -> None:
        item = self.in_flight.pop(0)
        lo, hi = item.bucket.owned(self.comm.rank)
        self._finish(item, self.flat_grad[lo:hi], accumulate=False)

    def end_backward(self) -> None:
        if not self.active:
            return
        while self.next_launch < len(self.layout.buckets):
            self._launch(self.layout.buckets[self.next_launch])
            self.next_launch += 1
        while self.in_flight:
            self._finish_oldest()
        self.active = False

    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradient chunks (views into the flat buffer)."""
        return self.shard_views

    def zero_(self) -> None:
        self.flat_grad.zero_()
        self._bind()

    def nbytes(self) -> int:
        return self.flat_grad.numel() * self.flat_grad.element_size()


class Stage2Reducer(_OrderedLauncher):
    """Gradient shard only; every backward reduce-scatters its buckets into it."""

    def __init__(self, layout: FlatLayout, params: list[torch.nn.Parameter], comm: CommGroup, dtype: torch.dtype,
                 device: torch.device, comm_dtype: torch.dtype | None, predivide: float, average: bool,
                 max_in_flight: int = 2) -> None:
        super().__init__(layout, params, comm, comm_dtype, predivide, average)
        self.dtype, self.device = dtype, device
        self.shard = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
        self.staging: dict[int, torch.Tensor] = {}
        self.max_in_flight = max(1, max_in_flight)
        for p in params:
            p.grad = None

    def begin_backward(self, reduce: bool) -> None:
        # stage 2 cannot hold unreduced full gradients between micro-steps: it always reduces
        self.active = True
        self.next_launch = 0
        for r in self.ready:
            r.clear()

    def _staging_for(self, bucket: int) -> torch.Tensor:
        buf = self.staging.get(bucket)
        if buf is None:
            b = self.layout.buckets[bucket]
            buf = torch.zeros(b.padded, dtype=self.dtype, device=self.device)
            self.staging[bucket] = buf
        return buf

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        s_index = self.slot_of[id(p)]
        slot = self.layout.slots[s_index]
        bucket = self.layout.buckets[slot.bucket]
        if p.grad is not None:
            off = slot.flat_start - bucket.start
            self._staging_for(slot.bucket)[off:off + slot.numel].copy_(p.grad.reshape(-1))
            p.grad = None
        if not self.active:
            return
        self.ready[slot.bucket].add(s_index)
        while self.next_launch < len(self.layout.buckets) and \
                len(self.ready[self.next_launch]) == len(self.members[self.next_launch]):
            self._launch(self.next_launch)

    def _launch(self, index: int) -> None:
        while len(self.in_flight) >= self.max_in_flight:
            self._finish_oldest()
        staging = self._staging_for(index)
        self._reduce_scatter(self.layout.buckets[index], staging, staging)
        self.next_launch = index + 1

    def _finish_oldest(self) -> None:
        item = self.in_flight.pop(0)
        off = self.layout.shard_offset(item.bucket)
        self._finish(item, self.shard[off:off + item.bucket.chunk], accumulate=True)
        self.staging.pop(item.bucket.index, None)

    def end_backward(self) -> None:
        if not self.active:
            return
        while self.next_launch < len(self.layout.buckets):
            self._launch(self.next_launch)
        while self.in_flight:
            self._finish_oldest()
        self.active = False

    def shard_grads(self) -> list[torch.Tensor]:
        return [self.shard[off:off + hi - lo] for lo, hi, off in self.layout.owned_ranges()]

    def zero_(self) -> None:
        self.shard.zero_()

    def nbytes(self) -> int:
        return self.shard.numel() * self.shard.element_size()

    def staging_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.staging.values())
