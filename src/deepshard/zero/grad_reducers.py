"""Gradient reduction for ZeRO stages 1 and 2, bucket by bucket, in the flat layout of ``partition.py``.

Both reducers launch buckets strictly in index order (as stage 0 does) so every rank issues the same
collectives in the same order, and both leave each rank the *average* of its chunk of every bucket.
At most ``max_in_flight`` buckets are in flight at once (each holds the collective's scratch).

* Stage 1 keeps a full gradient buffer (``.grad`` are views into it, accumulation is local) and, at the
  accumulation boundary, reduce-scatters each bucket as soon as backward has produced it, back into the
  bucket's own chunk of that buffer.
* Stage 2 keeps only this rank's shard of the gradient. Every backward reduce-scatters each bucket
  straight from the ``.grad`` tensors autograd produced (``CommGroup.reduce_scatter_pieces``: no staging
  copy on gloo) as soon as all of them exist, adds its chunk into the shard and drops the ``.grad``s, so a
  process holds its gradient shard plus a few buckets of gradients, never the full gradient.
"""
from __future__ import annotations

import torch

from deepshard.comm.group import CommGroup
from deepshard.zero.grad_comm import GradReduce
from deepshard.zero.canonical import StepTree
from deepshard.zero.in_flight import InFlight, InFlightQueue, averaged, averaging_factor
from deepshard.zero.local_steps import LocalSteps
from deepshard.zero.partition import FlatLayout


class _OrderedLauncher:
    """Shared machinery: readiness per bucket, in-order launch, the averaging factor. ``domains[d]`` is
    the group a bucket of domain ``d`` is reduced over (domain 0: ``comm``; others: experts'
    expert-data-parallel groups); every sum is divided by ``comm.size`` (``averaging_factor``). Domain 0 goes
    through ``grad_reduce`` (``zero/grad_comm.py``: with hybrid sharding, a reduce-scatter over ``comm``, the
    shard group, then an all-reduce across the replicas; the sum then runs over ``grad_reduce.world`` ranks)."""

    def __init__(self, layout: FlatLayout, params: list[torch.nn.Parameter], comm: CommGroup,
                 comm_dtype: torch.dtype | None, predivide: float, average: bool, max_in_flight: int,
                 domains: list[CommGroup] | None = None, grad_reduce: GradReduce | None = None) -> None:
        self.layout, self.params, self.comm = layout, params, comm
        self.domains = [comm] + list(domains or [])[1:]
        self.grad_reduce = grad_reduce if grad_reduce is not None else GradReduce(comm)
        self.comm_dtype, self.predivide = comm_dtype, predivide
        self.post = averaging_factor(predivide, self.grad_reduce.world, average)
        self.in_flight = InFlightQueue(max_in_flight, self._finish)
        self.slot_of = {id(params[s.param_index]): i for i, s in enumerate(layout.slots)}
        self.members: list[list[int]] = [[] for _ in layout.buckets]
        for i, s in enumerate(layout.slots):
            self.members[s.bucket].append(i)
        self.ready: list[set[int]] = [set() for _ in layout.buckets]
        self.next_launch = 0
        self.active = False
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def comm_of(self, index: int) -> CommGroup:
        """The group bucket ``index`` is reduced over."""
        return self.domains[self.layout.buckets[index].domain]

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        raise NotImplementedError

    def _launch(self, index: int) -> None:
        raise NotImplementedError

    def _finish(self, item: InFlight) -> None:
        raise NotImplementedError

    def _mark_ready(self, s_index: int) -> None:
        """Record that slot ``s_index`` has its gradient and launch every bucket that is complete, in order."""
        self.ready[self.layout.slots[s_index].bucket].add(s_index)
        while self.next_launch < len(self.layout.buckets) and \
                len(self.ready[self.next_launch]) == len(self.members[self.next_launch]):
            self._launch_next()

    def _launch_next(self) -> None:
        self.in_flight.make_room()
        self._launch(self.next_launch)
        self.next_launch += 1

    def begin_backward(self, reduce: bool) -> None:
        self.active = reduce and self.grad_reduce.world > 1
        self.next_launch = 0
        for r in self.ready:
            r.clear()

    def end_backward(self) -> None:
        if not self.active:
            return
        while self.next_launch < len(self.layout.buckets):
            self._launch_next()
        self.in_flight.drain()
        self.active = False

    def scratch_bytes(self) -> int:
        return self.in_flight.scratch_bytes()

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()


class Stage1Reducer(_OrderedLauncher):
    """Full local gradient buffer; reduce-scatter at the accumulation boundary."""

    def __init__(self, layout: FlatLayout, params: list[torch.nn.Parameter], comm: CommGroup, dtype: torch.dtype,
                 device: torch.device, comm_dtype: torch.dtype | None, predivide: float, average: bool,
                 max_in_flight: int = 2, domains: list[CommGroup] | None = None,
                 grad_reduce: GradReduce | None = None, tree_factor: float | None = None,
                 local_factor: float | None = None) -> None:
        """``tree_factor``: the deterministic mode with accumulation, interleaved split: every micro-step is
        reduce-scattered and the steps' chunks are summed in the canonical tree (``zero/canonical.py``), times
        this factor. ``local_factor``: its contiguous split: this rank's micro-steps are summed in the tree
        (``zero/local_steps.py``), reduce-scattered once at the boundary and multiplied by this factor."""
        super().__init__(layout, params, comm, comm_dtype, predivide, average, max_in_flight, domains, grad_reduce)
        self.tree_factor = tree_factor
        self.tree = (StepTree(torch.zeros(layout.shard_numel, dtype=dtype, device=device))
                     if tree_factor is not None else None)
        self.boundary = True
        self.open = False
        self.flat_grad = torch.zeros(layout.total, dtype=dtype, device=device)
        self.views = [self.flat_grad[s.flat_start:s.flat_start + s.numel].view(s.shape) for s in layout.slots]
        self.local: LocalSteps | None = None
        if local_factor is not None:
            self.local = LocalSteps(self.flat_grad, [(params[s.param_index], s.flat_start) for s in layout.slots],
                                    predivide)
            self.post = local_factor
            self.views = self.local.views(0)
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
        if self.local is not None and self.local.begin():  # a later micro-step: a cleared buffer of its own
            self.views = self.local.views()
        else:
            self._bind()
        super().begin_backward(reduce)
        self.boundary = reduce
        self.open = True  # end_backward may be called again (the engine's step waits too): act once
        if self.tree is not None:  # the canonical tree needs each micro-step reduced on its own (even alone)
            self.active = True

    def end_backward(self) -> None:
        """Deterministic mode: this micro-step's chunks join the tree and the local gradient is cleared for the
        next one; at the boundary the tree's sum becomes the owned chunks of the flat gradient."""
        launched, was_open = self.active, self.open
        super().end_backward()
        self.open = False
        if self.local is not None:
            if was_open:
                self._end_local(launched)
            return
        if self.tree is None or not launched:
            return
        self.tree.commit()
        self.flat_grad.zero_()
        if self.boundary:
            result = self.tree.finish(self.tree_factor)  # type: ignore[arg-type]
            for (lo, hi, off), view in zip(self.layout.owned_ranges(), self.shard_views):
                view.copy_(result[off:off + hi - lo])

    def _end_local(self, launched: bool) -> None:
        """Contiguous split: a micro-step before the boundary joins this rank's tree; at the boundary every
        bucket was closed and reduced as it launched (on one rank: closed and averaged here)."""
        assert self.local is not None
        if not self.boundary:
            self.local.commit()
            return
        if not launched:
            self.local.close()
            if self.post != 1.0:
                self.flat_grad.mul_(self.post)
        self.local.finish()
        self.views = self.local.views(0)

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        s_index = self.slot_of[id(p)]
        view = self.views[s_index]
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view
        if self.active:
            self._mark_ready(s_index)

    def _launch(self, index: int) -> None:
        """Reduce-scatter the bucket's range of the flat buffer; the result lands in its own chunk where
        the backend can write a chunk of its input (pairwise collectives, no dtype conversion)."""
        bucket = self.layout.buckets[index]
        if self.local is not None:  # contiguous split: this rank's sum of the bucket over its micro-steps first
            self.local.close(bucket.start, bucket.start + bucket.padded)
        full = self.flat_grad[bucket.start:bucket.start + bucket.padded]
        send = full if self.comm_dtype is None or self.comm_dtype == full.dtype else full.to(self.comm_dtype)
        if self.predivide != 1.0 and self.local is None:
            send.div_(self.predivide)  # the buffer is zeroed after the step
        lo, hi = bucket.owned()
        comm = self.comm_of(index)
        if comm.pairwise_for(full) and send is full:  # the result may land in its own input
            out = self.flat_grad[lo:hi]
        else:
            out = torch.empty(bucket.chunk, dtype=send.dtype, device=send.device)
        if bucket.domain == 0:
            work = self.grad_reduce.start_tensor(out, send)
        else:
            work = comm.reduce_scatter_tensor(out, send, async_op=True)
        self.in_flight.add(InFlight(index, work, out, [send]))

    def _finish(self, item: InFlight) -> None:
        item.work.wait()
        lo, hi = self.layout.buckets[item.index].owned()
        target, out = self.flat_grad[lo:hi], item.out
        assert out is not None
        if self.tree is not None:
            off = self.layout.shard_offset(self.layout.buckets[item.index])
            self.tree.current()[off:off + hi - lo].copy_(out)
            return
        if out.data_ptr() != target.data_ptr():
            target.copy_(out)
        if self.post != 1.0:
            target.mul_(self.post)

    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradient chunks (views into the flat buffer)."""
        return self.shard_views

    def zero_(self) -> None:
        self.flat_grad.zero_()
        if self.local is not None:
            self.local.finish()
            self.views = self.local.views(0)
        self._bind()

    def nbytes(self) -> int:
        extra = self.local.nbytes() if self.local is not None else 0
        return self.flat_grad.numel() * self.flat_grad.element_size() + extra


class Stage2Reducer(_OrderedLauncher):
    """Gradient shard only; every backward reduce-scatters its buckets into it (in the deterministic mode
    into the partial sums of the canonical tree over micro-steps, ``zero/canonical.py``)."""

    def __init__(self, layout: FlatLayout, params: list[torch.nn.Parameter], comm: CommGroup, dtype: torch.dtype,
                 device: torch.device, comm_dtype: torch.dtype | None, predivide: float, average: bool,
                 max_in_flight: int = 2, domains: list[CommGroup] | None = None,
                 grad_reduce: GradReduce | None = None, tree_factor: float | None = None) -> None:
        """``tree_factor``: the deterministic mode with accumulation (the factor of the canonical sum)."""
        super().__init__(layout, params, comm, comm_dtype, predivide, average, max_in_flight, domains, grad_reduce)
        self.dtype, self.device = dtype, device
        self.shard = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
        self.tree = StepTree(self.shard) if tree_factor is not None else None
        self.tree_factor = tree_factor
        self.boundary = True
        self.holding = False
        """``engine.coalesce_grad_reduction()``: backward passes leave their gradients on ``.grad`` (autograd
        adds them up) and reduce nothing; the next reducing backward (the block's exit) reduces the sum."""
        for p in params:
            p.grad = None

    def begin_backward(self, reduce: bool) -> None:
        super().begin_backward(reduce)
        # stage 2 keeps no unreduced full gradient between micro-steps (it always reduces), unless told to
        self.active = not self.holding
        self.boundary = reduce

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if self.active:
            self._mark_ready(self.slot_of[id(p)])

    def _launch(self, index: int) -> None:
        """Reduce-scatter the bucket's ``.grad`` tensors as they are (they leave the parameters now and
        live in the in-flight item until the collective is done)."""
        pieces = []
        for s_index in self.members[index]:
            slot = self.layout.slots[s_index]
            p = self.params[slot.param_index]
            pieces.append(grad_piece(p.grad, slot.numel, self.dtype, self.device, self.comm_dtype, self.predivide))
            p.grad = None
        bucket = self.layout.buckets[index]
        work = (self.grad_reduce.start_pieces(pieces, bucket.chunk) if bucket.domain == 0
                else self.comm_of(index).reduce_scatter_pieces(pieces, bucket.chunk))
        self.in_flight.add(InFlight(index, work, held=pieces))

    def _finish(self, item: InFlight) -> None:
        item.work.wait()
        bucket = self.layout.buckets[item.index]
        off = self.layout.shard_offset(bucket)
        if self.tree is not None:
            self.tree.current()[off:off + bucket.chunk].copy_(item.work.result)
        else:
            self.shard[off:off + bucket.chunk].add_(averaged(item.work.result, self.dtype, self.post))

    def end_backward(self) -> None:
        launched = self.active
        super().end_backward()
        if not launched:  # holding: the gradients stay on .grad
            return
        for p in self.params:  # a parameter whose bucket was reduced before it got a gradient
            p.grad = None
        if self.tree is not None and launched:
            self.tree.commit()
            if self.boundary:
                self.tree.finish(self.tree_factor)  # type: ignore[arg-type]

    def shard_grads(self) -> list[torch.Tensor]:
        return [self.shard[off:off + hi - lo] for lo, hi, off in self.layout.owned_ranges()]

    def zero_(self) -> None:
        self.shard.zero_()

    def nbytes(self) -> int:
        return self.shard.numel() * self.shard.element_size()


def grad_piece(grad: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device,
                comm_dtype: torch.dtype | None, predivide: float) -> torch.Tensor:
    """A gradient as a 1-D contiguous tensor in the communication dtype, divided by ``predivide``
    (zeros for a parameter that got no gradient). Works in place on ``grad`` where it can: the
    caller has taken it off its parameter."""
    if grad is None:
        return torch.zeros(numel, dtype=comm_dtype or dtype, device=device)
    piece = grad.reshape(-1)
    if not piece.is_contiguous():
        piece = piece.contiguous()
    if comm_dtype is not None and piece.dtype != comm_dtype:
        piece = piece.to(comm_dtype)
    if predivide != 1.0:
        piece.div_(predivide)
    return piece
