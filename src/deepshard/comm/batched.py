"""The rest of DeepSpeed 0.19.8's ``deepspeed.comm`` collectives: Python objects (``all_gather_object``),
several tensors in one call (``all_gather_coalesced``, ``all_reduce_coalesced``), batched point-to-point
(``P2POp`` + ``batch_isend_irecv``), and the ``has_*`` questions DeepSpeed's callers ask before choosing a
path. Each runs ``torch.distributed``'s own and is counted in :data:`deepshard.comm.api.COMMS_LOGGER`."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from deepshard.comm.api import COMMS_LOGGER, ReduceOp, irecv, isend

ProcessGroup = dist.ProcessGroup
GradBucket = dist.GradBucket

__all__ = ["GradBucket", "P2POp", "all_gather_coalesced", "all_gather_object", "all_reduce_coalesced",
           "batch_isend_irecv", "has_all_gather_into_tensor", "has_all_reduce_coalesced",
           "has_coalescing_manager", "has_reduce_scatter_tensor"]


def all_gather_object(object_list: list[Any], obj: Any, group: Optional[ProcessGroup] = None) -> None:
    """Every rank's picklable ``obj`` into ``object_list`` (one slot per rank of ``group``, rank order)."""
    COMMS_LOGGER.record("all_gather_object", len(object_list), 1)
    dist.all_gather_object(object_list, obj, group=group)


def all_gather_coalesced(output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                         group: Optional[ProcessGroup] = None, async_op: bool = False) -> Any:
    """For each pair, every rank's ``input_tensors[i]`` concatenated into ``output_tensors[i]``, issued
    together; with ``async_op`` one handle whose ``wait()`` waits for all of them."""
    if len(output_tensors) != len(input_tensors):
        raise ValueError(f"all_gather_coalesced got {len(output_tensors)} output tensors for "
                         f"{len(input_tensors)} inputs; give one output per input")
    for out in output_tensors:
        COMMS_LOGGER.record("all_gather", out.numel(), out.element_size())
    handles = [dist.all_gather_into_tensor(out, inp, group=group, async_op=True)
               for out, inp in zip(output_tensors, input_tensors)]
    work = _AllWork(handles)
    if async_op:
        return work
    work.wait()
    return None


def all_reduce_coalesced(tensors: list[torch.Tensor], op: Any = ReduceOp.SUM,
                         group: Optional[ProcessGroup] = None, async_op: bool = False) -> Any:
    """All-reduce each tensor of ``tensors`` in place, issued together (torch has no coalesced
    all-reduce for every backend any more, so this is one asynchronous all-reduce per tensor)."""
    for tensor in tensors:
        COMMS_LOGGER.record("all_reduce", tensor.numel(), tensor.element_size(), 2.0)
    work = _AllWork([dist.all_reduce(t, op=op, group=group, async_op=True) for t in tensors])
    if async_op:
        return work
    work.wait()
    return None


class _AllWork:
    """Several requests waited on as one (what the coalesced calls return with ``async_op=True``)."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = [h for h in handles if h is not None]

    def wait(self) -> bool:
        for handle in self.handles:
            handle.wait()
        return True

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self.handles)


class P2POp:
    """One send or receive of :func:`batch_isend_irecv`: ``op`` is ``deepspeed.comm.isend`` or
    ``irecv`` (torch's ``isend``/``irecv`` are accepted too), ``peer`` a global rank."""

    def __init__(self, op: Any, tensor: torch.Tensor, peer: int, group: Optional[ProcessGroup] = None,
                 tag: int = 0) -> None:
        if op in (isend, dist.isend):
            self.op = "isend"
        elif op in (irecv, dist.irecv):
            self.op = "irecv"
        else:
            raise ValueError(f"P2POp op must be deepspeed.comm.isend or deepspeed.comm.irecv, got {op!r}")
        self.tensor, self.peer, self.group, self.tag = tensor, peer, group, tag

    def __repr__(self) -> str:
        return f"P2POp({self.op}, peer={self.peer}, shape={tuple(self.tensor.shape)}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Any]:
    """Start every send and receive of ``p2p_op_list`` at once; the requests, to ``wait()`` on."""
    ops = []
    for p2p in p2p_op_list:
        COMMS_LOGGER.record("send" if p2p.op == "isend" else "recv", p2p.tensor.numel(), p2p.tensor.element_size())
        ops.append(dist.P2POp(getattr(dist, p2p.op), p2p.tensor, p2p.peer, p2p.group, p2p.tag))
    return dist.batch_isend_irecv(ops)


def has_all_gather_into_tensor() -> bool:
    """Whether torch has the single-tensor all-gather (``all_gather_into_tensor``): every supported torch."""
    return hasattr(dist, "all_gather_into_tensor")


def has_reduce_scatter_tensor() -> bool:
    """Whether torch has the single-tensor reduce-scatter (``reduce_scatter_tensor``)."""
    return hasattr(dist, "reduce_scatter_tensor")


def has_all_reduce_coalesced() -> bool:
    """Whether :func:`all_reduce_coalesced` is available (always: it is built on plain all-reduces)."""
    return True


def has_coalescing_manager() -> bool:
    """Whether torch's collective coalescing manager exists (DeepSpeed batches with it when it does)."""
    return hasattr(dist.distributed_c10d, "_coalescing_manager")
