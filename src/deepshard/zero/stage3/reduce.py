"""ZeRO-3 gradient reduction: each group's gradients are reduce-scattered into this rank's gradient
shard as soon as backward has produced all of them (straight from ``.grad``, see
``CommGroup.reduce_scatter_pieces``), and the group's gathered parameters are released.

Groups are launched in the order backward completes them, which is the same on every rank (the same
graph runs everywhere); groups that got no gradient are launched at the end of backward in index
order. So are the groups of *leaf* modules (``set_z3_leaf_modules``): a leaf's children may run on some
ranks and not others (a mixture-of-experts block routing tokens to different experts), so when their
gradients are complete differs between ranks; the end of backward is the one point all ranks share. At
most ``max_in_flight`` groups are staged at once, so a process holds its gradient shard plus a few
groups' gradients, never the full gradient.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from deepshard.comm.group import CommGroup
from deepshard.zero.grad_comm import GradReduce
from deepshard.zero.grad_reducers import grad_piece
from deepshard.zero.in_flight import InFlight, InFlightQueue, averaged, averaging_factor
from deepshard.zero.stage3.group import ShardedGroup


class Stage3Reducer:
    def __init__(self, groups: list[ShardedGroup], shard_offsets: list[int], comm: CommGroup,
                 accumulate: Callable[[int, torch.Tensor, float], None], comm_dtype: torch.dtype | None, predivide: float, average: bool,
                 waiter: Callable[[Any, str], None], max_in_flight: int = 2,
                 on_reduced: Callable[[int, torch.Tensor], None] | None = None,
                 on_release: Callable[[ShardedGroup], None] | None = None,
                 grad_reduce: GradReduce | None = None, deferred: set[int] | None = None,
                 average_chunks: bool = True) -> None:
        """``accumulate(shard offset, reduced chunk, factor)`` adds factor x chunk into the gradient shard;
        ``on_reduced(group index, averaged chunk)``, when given, takes each group's reduced chunk instead
        (an optimizer step in backward). ``grad_reduce``: how a group's gradients are reduced (default: a
        reduce-scatter over ``comm``; hybrid sharding and qgZ: ``zero/grad_comm.py``). ``deferred``: indices
        of groups reduced at the end of backward only (leaf modules' groups). ``average_chunks`` False: chunks
        are handed on as summed (the deterministic mode averages the canonical sum over micro-steps once, at
        the boundary)."""
        self.groups, self.offsets, self.comm = groups, shard_offsets, comm
        self.grad_reduce = grad_reduce if grad_reduce is not None else GradReduce(comm)
        self.on_reduced = on_reduced
        self.on_release = on_release
        self.deferred = deferred or set()
        self.accumulate = accumulate
        self.comm_dtype, self.predivide = comm_dtype, predivide
        self.post = averaging_factor(predivide, self.grad_reduce.world, average) if average_chunks else 1.0
        self.waiter = waiter
        self.in_flight = InFlightQueue(max_in_flight, self._finish)
        self.launched: set[int] = set()
        self.open = False  # between begin_backward and end_backward
        self.holding = False
        """``engine.coalesce_grad_reduction()``: each gradient is added into ``held`` (its parameter's local,
        unreduced sum over the block's backward passes) instead of being reduced; the next launch of its
        group reduces the sum."""
        self.held: dict[int, torch.Tensor] = {}
        self.ready: list[int] = [0] * len(groups)
        self.expected = [sum(1 for p in g.params if p.requires_grad) for g in groups]
        self.group_of: dict[int, int] = {id(p): gi for gi, g in enumerate(groups) for p in g.params}
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for g in groups for p in g.params
                      if p.requires_grad]

    def begin_backward(self) -> None:
        self.open = True
        self.launched.clear()
        self.ready = [0] * len(self.groups)

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        gi = self.group_of[id(p)]
        self.ready[gi] += 1
        if self.holding:
            self._hold(p)
        if self.ready[gi] == self.expected[gi] and gi not in self.launched and gi not in self.deferred:
            if not self.holding:
                self._launch(gi)
            group = self.groups[gi]
            if group.users == 0:
                group.reshard()
                if self.on_release is not None:
                    self.on_release(group)

    def _hold(self, p: torch.nn.Parameter) -> None:
        """Move ``p``'s new gradient into its held sum (autograd starts the next backward from no ``.grad``)."""
        grad, p.grad = p.grad, None
        if grad is None:
            return
        held = self.held.get(id(p))
        if held is None:
            self.held[id(p)] = grad
        else:
            held.add_(grad)

    def _grad_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """``p``'s gradient to reduce: the held sum plus what ``.grad`` holds, either alone where one is None."""
        held, grad = self.held.pop(id(p), None), p.grad
        if held is None:
            return grad
        return held if grad is None else held.add_(grad)

    def _launch(self, gi: int) -> None:
        """Reduce-scatter the group's ``.grad`` tensors as autograd produced them (no staging copy on
        gloo); they leave the parameters now and live in the in-flight item until the collective is done."""
        self.in_flight.make_room()
        group = self.groups[gi]
        pieces = []
        for p, n in zip(group.params, group.numels):
            pieces.append(grad_piece(self._grad_of(p), n, group.dtype, group.device, self.comm_dtype,
                                     self.predivide))
            p.grad = None
        if group.comm is self.comm:
            work = self.grad_reduce.start_pieces(pieces, group.chunk, key=2 * group.index + 2)
        else:  # an expert's group: over its own expert-data-parallel ranks (averaged over all, as DeepSpeed does)
            work = group.comm.reduce_scatter_pieces(pieces, group.chunk, key=2 * group.index + 2)
        self.in_flight.add(InFlight(gi, work, held=pieces))
        self.launched.add(gi)

    def _finish(self, item: InFlight) -> None:
        group = self.groups[item.index]
        self.waiter(item.work, f"reduce_scatter of gradient group {group.index} ({group.module_name})")
        if self.on_reduced is not None:
            chunk = item.work.result
            self.on_reduced(item.index, chunk.mul_(self.post) if self.post != 1.0 else chunk)
            return
        self.accumulate(self.offsets[item.index], averaged(item.work.result, group.dtype, self.post), 1.0)

    def finish_in_flight(self) -> None:
        """Complete the reduce-scatters in flight (a module's backward is about to produce more
        gradients: what the earlier ones hold leaves first)."""
        self.in_flight.drain()

    def end_backward(self) -> bool:
        """Launch the groups no gradient reached, finish every reduce-scatter; True when this closed a
        backward (False for a second call)."""
        closing, self.open = self.open, False
        for gi in range(len(self.groups)):
            if self.holding:  # a gradient that reached .grad without its hook (none expected): held too
                for p in self.groups[gi].params:
                    if p.grad is not None:
                        self._hold(p)
            elif gi not in self.launched:
                self._launch(gi)
        self.in_flight.drain()
        return closing

    def scratch_bytes(self) -> int:
        return self.in_flight.scratch_bytes()

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
