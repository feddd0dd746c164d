"""The sequence-parallel exchanges, differentiable: the all-to-all (Ulysses), the ring pass of
key/value blocks (receives posted before the sender computes, so gloo's thread copies while this rank
works), and the sum over the group of a loss.

Every function takes a counted ``CommGroup`` (``deepshard.comm``); :func:`as_comm` wraps the plain torch
process groups that DeepSpeed's API passes around.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from deepshard.comm.group import CommGroup

RING_TAG = 7301  # the ring's point-to-point tag (one message in flight per direction at a time)


def as_comm(group: Any, name: str = "sp") -> CommGroup:
    """``group`` as a counted ``CommGroup``: a ``CommGroup`` as it is, a torch ``ProcessGroup`` (or None,
    the world) wrapped."""
    if isinstance(group, CommGroup):
        return group
    return CommGroup(group=group, name=name)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: CommGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.comm, ctx.dims = comm, (scatter_dim, gather_dim)
        return _all_to_all(x, comm, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), ctx.comm, gather_dim, scatter_dim), None, None, None


def _all_to_all(x: torch.Tensor, comm: CommGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    n = comm.size
    if x.shape[scatter_dim] % n != 0:
        raise ValueError(f"all-to-all over {n} ranks: dimension {scatter_dim} of {tuple(x.shape)} does not split "
                         f"evenly (pad it to a multiple of {n} first)")
    send = torch.stack(x.chunk(n, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send)
    return torch.cat(recv.unbind(0), dim=gather_dim)


def all_to_all(x: torch.Tensor, comm: CommGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``scatter_dim`` over the ranks and concatenate what each rank sends along ``gather_dim``
    (rank order); the backward is the inverse exchange."""
    if comm.size == 1:
        return x
    return _AllToAll.apply(x, comm, scatter_dim, gather_dim)


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: CommGroup) -> torch.Tensor:
        ctx.comm = comm
        out = x.detach().clone()
        comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None]:
        out = grad.detach().clone()
        ctx.comm.all_reduce(out)
        return out, None


def sum_over_group(x: torch.Tensor, comm: CommGroup) -> torch.Tensor:
    """The sum of ``x`` over the ranks, the same on each; its gradient is the sum of the ranks' gradients
    (``torch.distributed.nn.functional.all_reduce``'s rule), so every rank backpropagates the whole loss."""
    if comm.size == 1:
        return x
    return _SumOverGroup.apply(x, comm)


class RingPass:
    """One hop around ``comm``'s ring: send to the next rank, receive from the previous one. The receive
    is posted before the send and before this rank computes on the block it holds."""

    def __init__(self, comm: CommGroup) -> None:
        self.comm = comm
        n = comm.size
        self.next = comm.peers[(comm.rank + 1) % n]
        self.prev = comm.peers[(comm.rank - 1) % n]
        self._works: list[Any] = []
        self._recv: Optional[torch.Tensor] = None

    def start(self, send: torch.Tensor) -> None:
        """Post the receive of a tensor shaped like ``send`` and send ``send`` (kept alive until ``finish``)."""
        send = send.contiguous()
        self._recv = torch.empty_like(send)
        self.comm.logger.record(self.comm._label("ring_send"), send.numel(), send.element_size(),
                                group_size=self.comm.size)
        self._works = [dist.irecv(self._recv, self.prev, group=self.comm.group, tag=RING_TAG),
                       dist.isend(send, self.next, group=self.comm.group, tag=RING_TAG)]
        self._send = send

    def finish(self) -> torch.Tensor:
        """Wait for both transfers; the received tensor."""
        for work in self._works:
            self.comm.wait(work, "sequence-parallel ring pass")
        recv, self._recv, self._works, self._send = self._recv, None, [], None
        assert recv is not None
        return recv
