"""ZeRO-3 gradient reduction: each group's gradients are reduce-scattered into this rank's gradient
shard as soon as backward has produced all of them, and the group's gathered parameters are released.

Groups are launched in the order backward completes them, which is the same on every rank (the same
graph runs everywhere); groups that got no gradient are launched at the end of backward in index
order. At most ``max_in_flight`` groups are staged at once, so a process holds its gradient shard plus a
few groups' gradients, never the full gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from deepshard.comm.group import CommGroup
from deepshard.zero.stage3.group import ShardedGroup


@dataclass
class _InFlight:
    group: int
    work: Any
    out: torch.Tensor


class Stage3Reducer:
    def __init__(self, groups: list[ShardedGroup], shard_offsets: list[int], comm: CommGroup,
                 grad_shard: torch.Tensor, comm_dtype: torch.dtype | None, predivide: float, average: bool,
                 waiter: Callable[[Any, str], None], max_in_flight: int = 2) -> None:
        self.groups, self.offsets, self.comm = groups, shard_offsets, comm
        self.grad_shard = grad_shard
        self.comm_dtype, self.predivide = comm_dtype, predivide
        self.post = (predivide / comm.size) if average else predivide
        self.waiter = waiter
        self.max_in_flight = max(1, max_in_flight)
        self.staging: dict[int, torch.Tensor] = {}
        self.in_flight: list[_InFlight] = []
        self.launched: set[int] = set()
        self.ready: list[int] = [0] * len(groups)
        self.expected = [sum(1 for p in g.params if p.requires_grad) for g in groups]
        self.where: dict[int, tuple[int, int]] = {}
        for gi, g in enumerate(groups):
            offset = 0
            for p, n in zip(g.params, g.numels):
                self.where[id(p)] = (gi, offset)
                offset += n
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for g in groups for p in g.params
                      if p.requires_grad]

    def begin_backward(self) -> None:
        self.launched.clear()
        self.ready = [0] * len(self.groups)

    def _staging_for(self, gi: int) -> torch.Tensor:
        buf = self.staging.get(gi)
        if buf is None:
            g = self.groups[gi]
            buf = torch.zeros(g.padded, dtype=g.dtype, device=g.device)
            self.staging[gi] = buf
        return buf

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        gi, offset = self.where[id(p)]
        if p.grad is not None:
            self._staging_for(gi)[offset:offset + p.grad.numel()].add_(p.grad.reshape(-1))
            p.grad = None
        self.ready[gi] += 1
        if self.ready[gi] == self.expected[gi] and gi not in self.launched:
            self._launch(gi)
            group = self.groups[gi]
            if group.users == 0:
                group.reshard()

    def _launch(self, gi: int) -> None:
        while len(self.in_flight) >= self.max_in_flight:
            self._finish_oldest()
        staging = self._staging_for(gi)
        send = staging if self.comm_dtype is None or self.comm_dtype == staging.dtype else staging.to(self.comm_dtype)
        if self.predivide != 1.0:
            send.div_(self.predivide)
        group = self.groups[gi]
        if self.comm.pairwise and send is staging:  # the reduced chunk lands in the staging buffer itself
            out = staging[self.comm.rank * group.chunk:(self.comm.rank + 1) * group.chunk]
        else:
            out = torch.empty(group.chunk, dtype=send.dtype, device=send.device)
        work = self.comm.reduce_scatter_tensor(out, send, async_op=True)
        self.in_flight.append(_InFlight(gi, work, out))
        self.launched.add(gi)

    def _finish_oldest(self) -> None:
        item = self.in_flight.pop(0)
        group = self.groups[item.group]
        self.waiter(item.work, f"reduce_scatter of gradient group {group.index} ({group.module_name})")
        chunk = item.out.to(self.grad_shard.dtype) if item.out.dtype != self.grad_shard.dtype else item.out
        if self.post != 1.0:
            chunk.mul_(self.post)
        off = self.offsets[item.group]
        self.grad_shard[off:off + group.chunk].add_(chunk)
        self.staging.pop(item.group, None)

    def end_backward(self) -> None:
        for gi in range(len(self.groups)):
            if gi not in self.launched:
                self._launch(gi)
        while self.in_flight:
            self._finish_oldest()

    def staging_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.staging.values())

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
