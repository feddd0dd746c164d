"""DeepSpeed's module-level ``deepspeed.comm`` functions, for user scripts and libraries that call them.

Each collective runs ``torch.distributed``'s own on the group given (None = the world) and is counted
in :data:`COMMS_LOGGER`, which ``deepshard.comm.log_summary()`` reports next to every engine's logger.
Volumes follow ``CommsLogger``'s accounting: all-reduce 2x its tensor, all-gather the gathered output,
reduce-scatter the full input, everything else the tensor handed in.

These functions hold no process group of their own: the group is an argument, as in torch. deepshard's
own collectives go through :class:`deepshard.comm.group.CommGroup` objects, not through this module.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from deepshard.comm.logger import CommsLogger
from deepshard.distributed import get_local_rank, init_distributed

ReduceOp = dist.ReduceOp
ProcessGroup = dist.ProcessGroup

# the counters of the calls made through this module (a logger, not process-group state)
COMMS_LOGGER = CommsLogger(name="deepshard.comm")

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = [
    "COMMS_LOGGER", "ProcessGroup", "ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce",
    "all_to_all", "all_to_all_single", "allgather_fn", "barrier", "broadcast", "broadcast_object_list",
    "configure", "destroy_process_group", "gather", "get_backend", "get_global_rank", "get_local_rank",
    "get_rank", "get_world_group", "get_world_size", "inference_all_reduce", "init_distributed", "irecv",
    "is_available", "is_initialized", "isend", "monitored_barrier", "new_group", "recv", "reduce",
    "reduce_scatter", "reduce_scatter_fn", "reduce_scatter_tensor", "scatter", "send",
]


def _count(op: str, tensor: torch.Tensor, volume_factor: float = 1.0, numel: int | None = None) -> None:
    COMMS_LOGGER.record(op, tensor.numel() if numel is None else numel, tensor.element_size(), volume_factor)


def configure(deepspeed_config: Any = None, enabled: bool | None = None, prof_all: bool | None = None,
              prof_ops: Any = None, verbose: bool | None = None, debug: bool | None = None) -> None:
    """DeepSpeed's ``deepspeed.comm.configure``: turn this module's logger's printing on or off.
    Counting is always on; ``prof_all`` / ``prof_ops`` / ``debug`` are accepted and change nothing."""
    section = getattr(deepspeed_config, "comms_logger", None)
    if section is not None:
        COMMS_LOGGER.enabled = bool(section.enabled)
        COMMS_LOGGER.verbose = bool(section.verbose)
    if enabled is not None:
        COMMS_LOGGER.enabled = bool(enabled)
    if verbose is not None:
        COMMS_LOGGER.verbose = bool(verbose)


# ----------------------------------------------------------------------------------- process state
def is_available() -> bool:
    return dist.is_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Optional[ProcessGroup] = None) -> int:
    """This process's rank in ``group`` (0 when torch.distributed is not initialized, as DeepSpeed)."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Optional[ProcessGroup] = None) -> int:
    """Processes in ``group`` (1 when torch.distributed is not initialized)."""
    return dist.get_world_size(group) if is_initialized() else 1


def get_global_rank(group: Optional[ProcessGroup] = None, group_rank: int = 0) -> int:
    """The world rank of ``group``'s rank ``group_rank``."""
    if group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_world_group() -> ProcessGroup:
    return dist.group.WORLD


def get_backend(group: Optional[ProcessGroup] = None) -> str:
    return str(dist.get_backend(group))


def new_group(ranks: list[int]) -> ProcessGroup:
    """A process group of ``ranks`` for the user's own collectives (every rank must call it, in the same
    order). deepshard's own groups are built by its topology, never through this function."""
    return dist.new_group(ranks)


def destroy_process_group(group: Optional[ProcessGroup] = None) -> None:
    dist.destroy_process_group(group)


# ------------------------------------------------------------------------------------ collectives
def barrier(group: Optional[ProcessGroup] = None, async_op: bool = False, device_ids: Any = None) -> Any:
    COMMS_LOGGER.record("barrier", 0, 1)
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def monitored_barrier(group: Optional[ProcessGroup] = None, timeout: Any = None,
                      wait_all_ranks: bool = False) -> Any:
    """A barrier that names the ranks that did not arrive (gloo only, as in torch)."""
    COMMS_LOGGER.record("barrier", 0, 1)
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Optional[ProcessGroup] = None,
               async_op: bool = False) -> Any:
    _count("all_reduce", tensor, 2.0)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                         group: Optional[ProcessGroup] = None) -> Any:
    """DeepSpeed's inference-path all-reduce: a plain synchronous all-reduce here."""
    return all_reduce(tensor, op=op, group=group, async_op=False)


def broadcast(tensor: torch.Tensor, src: int, group: Optional[ProcessGroup] = None,
              async_op: bool = False) -> Any:
    """Broadcast from global rank ``src`` (torch's convention, which DeepSpeed keeps)."""
    _count("broadcast", tensor)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Optional[ProcessGroup] = None,
               async_op: bool = False) -> Any:
    _count("all_gather", tensor, numel=tensor.numel() * len(tensor_list))
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: Optional[ProcessGroup] = None, async_op: bool = False) -> Any:
    """Concatenate every rank's equally-sized ``input_tensor`` into ``output_tensor`` (rank order)."""
    _count("all_gather", output_tensor)
    return _all_gather(output_tensor, input_tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Optional[ProcessGroup] = None,
                 async_op: bool = False, debug: bool = False) -> Any:
    """DeepSpeed's name for :func:`all_gather_into_tensor`."""
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Optional[ProcessGroup] = None, async_op: bool = False) -> Any:
    """Reduce ``input_tensor`` over ranks and leave this rank's equal slice in ``output_tensor``."""
    _count("reduce_scatter", input_tensor)
    return _reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                      group: Optional[ProcessGroup] = None, async_op: bool = False, debug: bool = False) -> Any:
    """DeepSpeed's name for :func:`reduce_scatter_tensor`."""
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM,
                   group: Optional[ProcessGroup] = None, async_op: bool = False) -> Any:
    _count("reduce_scatter", output, numel=sum(t.numel() for t in input_list))
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Optional[ProcessGroup] = None,
           async_op: bool = False) -> Any:
    _count("reduce", tensor)
    return dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)


def gather(tensor: torch.Tensor, gather_list: Optional[list[torch.Tensor]] = None, dst: int = 0,
           group: Optional[ProcessGroup] = None, async_op: bool = False) -> Any:
    _count("gather", tensor)
    return dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: Optional[list[torch.Tensor]] = None, src: int = 0,
            group: Optional[ProcessGroup] = None, async_op: bool = False) -> Any:
    _count("scatter", tensor)
    return dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,  # noqa: A002 - torch's name
                      output_split_sizes: Optional[list[int]] = None,
                      input_split_sizes: Optional[list[int]] = None,
                      group: Optional[ProcessGroup] = None, async_op: bool = False) -> Any:
    _count("all_to_all", input)
    return dist.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes, group=group, async_op=async_op)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: Optional[ProcessGroup] = None, async_op: bool = False) -> Any:
    COMMS_LOGGER.record("all_to_all", sum(t.numel() for t in input_tensor_list),
                        input_tensor_list[0].element_size() if input_tensor_list else 1)
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def broadcast_object_list(object_list: list[Any], src: int, group: Optional[ProcessGroup] = None,
                          device: Optional[torch.device] = None) -> Any:
    COMMS_LOGGER.record("broadcast_object", len(object_list), 1)
    return dist.broadcast_object_list(object_list, src=src, group=group, device=device)


# ---------------------------------------------------------------------------------- point to point
def send(tensor: torch.Tensor, dst: int, group: Optional[ProcessGroup] = None, tag: int = 0) -> Any:
    _count("send", tensor)
    return dist.send(tensor, dst=dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: Optional[int] = None, group: Optional[ProcessGroup] = None,
         tag: int = 0) -> Any:
    _count("recv", tensor)
    return dist.recv(tensor, src=src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Optional[ProcessGroup] = None, tag: int = 0) -> Any:
    _count("send", tensor)
    return dist.isend(tensor, dst=dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group: Optional[ProcessGroup] = None,
          tag: int = 0) -> Any:
    _count("recv", tensor)
    return dist.irecv(tensor, src=src, group=group, tag=tag)
