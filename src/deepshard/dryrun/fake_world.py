"""One rank of an N-rank job in one process: torch's fake process group, with plausible values.

torch 2.13 ships a ``"fake"`` backend (``torch.distributed.Backend.FAKE``): ``init_process_group("fake",
rank=r, world_size=N)`` is the public route to it (torch imports its implementation, which lives under
``torch.testing._internal``, by itself; nothing private is imported here). Its collectives complete at
once without moving data: an all-reduce leaves the local tensor as it was, a reduce-scatter leaves this
rank's chunk of the local input, an all-gather copies the local shard into every slot, and a receive
leaves its buffer untouched.

Inside :func:`fake_world` a few functions of ``torch.distributed`` are replaced (on the module and on
the aliases deepshard keeps of them; undone after the block) so that the run stays faithful:

* **The transport of the real job.** On a CPU a real job runs on gloo, where deepshard's groups move
  data in pairwise exchanges (``comm/pairwise.py``) with their own receive buffers. ``get_backend``
  answers ``"gloo"`` for the fake group there, so the same code runs and allocates the same buffers
  (the shared-memory transport is switched off: it needs real peers; it allocates less, so the dry
  run's peak is an upper bound for a one-host job). On CUDA the fake group stands for NCCL's collectives.
* **Plausible values.** A receive from a peer gets what this rank itself sent that peer with the same
  tag and size (its own chunk, its own shard, its own flag), so a sum over N ranks comes out as N times the local value, as if every
  rank had held this rank's data; a receive with nothing to match is zeros. A native sum (``all_reduce``,
  ``reduce_scatter``) is scaled by the group's size for the same reason; averages, maxima and minima are
  the local values. A script's ``sum / world`` of its loss is therefore its local loss, not 1/N of it.
  A pipeline stage after the first receives from the stage before it the header that stage would send
  (``pipe_shapes.py``: those layers run on the meta device) and zero activations.
  ``broadcast_object_list`` keeps each rank's own objects.
"""
from __future__ import annotations

import contextlib
import os
import weakref
from collections import deque
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes  # as comm/shm.py: transport memory untracked

from deepshard.dryrun.patching import swapped

_SUMMED = ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor", "reduce")
_OP_AND_GROUP = {"all_reduce": (1, 2)}  # argument positions of op and group; the others take (2, 3)


def start(world_size: int, rank: int) -> None:
    """Initialize the default process group as rank ``rank`` of a fake world of ``world_size`` ranks."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"a dry run needs 0 <= rank < world_size, got rank {rank} of world size {world_size}")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process; a dry run starts its own "
                           "fake process group: run `deepshard dryrun` in a fresh process")
    dist.init_process_group("fake", rank=rank, world_size=world_size)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, name: str) -> Any:
    return kwargs.get(name, args[position] if len(args) > position else None)


def _scaled(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``original`` followed by multiplying its output by the group size when it sums (see the module)."""
    op_pos, group_pos = _OP_AND_GROUP.get(name, (2, 3))

    def call(*args: Any, **kwargs: Any) -> Any:
        work = original(*args, **kwargs)
        op = _arg(args, kwargs, op_pos, "op")
        tensor = kwargs.get("tensor", kwargs.get("output", args[0] if args else None))
        if (op is None or op == dist.ReduceOp.SUM) and isinstance(tensor, torch.Tensor) and tensor.dtype != torch.bool:
            size = dist.get_world_size(_arg(args, kwargs, group_pos, "group"))
            if size > 1:
                with torch.no_grad():
                    tensor.mul_(size)
        return work

    return call


Responder = Callable[[torch.Tensor], bool]
"""Fills a receive buffer with what a peer this rank cannot see would send; False: not that message."""


class _LateFill:
    """A receive's work whose buffer is filled when it is waited on (after the sends that precede it)."""

    def __init__(self, work: Any, fill: Callable[[], None]) -> None:
        self._work, self._fill = work, fill

    def _done(self) -> None:
        if self._fill is not None:
            fill, self._fill = self._fill, None
            fill()

    def wait(self, timeout: Any = None) -> bool:
        self._done()
        return True

    def is_completed(self) -> bool:
        self._done()
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _GlooSend:
    """A send's work as gloo reports it: completed only once waited on (gloo sets the flag in ``wait``), so
    code that drops the buffers of completed sends keeps them as long as in a real job. The fake group's own
    work says completed at once: a pipeline stage then freed its sent activations every few messages, where
    on gloo it holds every send of the batch until the batch ends (the dry run's peak was low by one
    activation per micro-batch and pipeline neighbour)."""

    def __init__(self, work: Any) -> None:
        self._work, self._waited = work, False

    def wait(self, timeout: Any = None) -> bool:
        self._waited = True
        return True

    def is_completed(self) -> bool:
        return self._waited

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _resolve(kept: Any) -> Any:
    """A kept send as a tensor: a small one's copy, or a large one's view rebuilt on its base (None once
    the base is freed)."""
    if isinstance(kept, torch.Tensor):
        return kept
    ref, shape, stride, offset = kept
    base = ref()
    if base is None:
        return None
    try:
        return base.as_strided(shape, stride, offset)
    except RuntimeError:  # its storage was released since (resized to nothing)
        return None


class Mailbox:
    """A receive from peer p gets a tensor this rank sent to p with the same tag and size (or what a
    responder for p says p would send; else zeros), when it is waited on. Small sends are copied (with the
    memory tracker's dispatch mode off), large ones held weakly: a send never keeps its tensor alive (the
    dry run's peak memory must be the real one's)."""

    SMALL = 4096  # bytes

    def __init__(self) -> None:
        self.sent: dict[tuple[int, int, int], deque[Any]] = {}
        self.responders: dict[int, Responder] = {}

    def expect(self, peer: int, responder: Responder) -> None:
        """Receives from global rank ``peer`` (of the default group) are answered by ``responder`` first."""
        self.responders[peer] = responder

    @staticmethod
    def _key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int, int]:
        group = _arg(args, kwargs, 2, "group")
        peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else 0))
        return id(group), int(_arg(args, kwargs, 3, "tag") or 0), int(peer or 0)

    def sending(self, original: Callable[..., Any], gloo: bool = False) -> Callable[..., Any]:
        """``original`` (a send) keeping what it sends; ``gloo``: its work completes as gloo's does."""
        def send(*args: Any, **kwargs: Any) -> Any:
            tensor: torch.Tensor = _arg(args, kwargs, 0, "tensor")
            if tensor.nbytes <= self.SMALL:
                with _disable_current_modes():  # the mailbox's copy is not the job's memory: untracked
                    kept: Any = tensor.detach().clone()
            else:  # a weak reference to the tensor's base: a send is often of a view made for the call alone
                base = tensor if tensor._base is None else tensor._base
                kept = (weakref.ref(base), tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
            self.sent.setdefault(self._key(args, kwargs), deque(maxlen=64)).append(kept)
            work = original(*args, **kwargs)
            return _GlooSend(work) if gloo and work is not None and not isinstance(work, int) else work

        return send

    def _fill(self, buffer: torch.Tensor, key: tuple[int, int, int], group: Any) -> None:
        responder = self.responders.get(key[2]) if group is None else None
        with torch.no_grad():
            if responder is not None and responder(buffer):
                return
            queue = self.sent.get(key, deque())
            for i, kept in enumerate(queue):
                source = _resolve(kept)
                if source is not None and source.numel() == buffer.numel() and source.dtype == buffer.dtype:
                    del queue[i]
                    buffer.copy_(source.reshape(buffer.shape))
                    return
            buffer.zero_()

    def receiving(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def recv(*args: Any, **kwargs: Any) -> Any:
            buffer: torch.Tensor = _arg(args, kwargs, 0, "tensor")
            key, group = self._key(args, kwargs), _arg(args, kwargs, 2, "group")
            work = original(*args, **kwargs)
            late = _LateFill(work, lambda: self._fill(buffer, key, group))
            if work is None or isinstance(work, int):  # the blocking form: filled now
                late.wait()
                return work
            return late

        return recv


def _keep_local_objects(object_list: list[Any], *args: Any, **kwargs: Any) -> None:
    """``broadcast_object_list`` in a fake world: every rank keeps the objects it passed in."""
    return None


def _backend_as(original: Callable[..., Any], stand_in: str) -> Callable[..., Any]:
    def get_backend(group: Any = None) -> Any:
        backend = original(group)
        return stand_in if str(backend) == "fake" else backend

    return get_backend


def replacements(device_type: str, mailbox: Mailbox) -> dict[Any, Any]:
    """What :func:`fake_world` swaps in (see the module docstring), for a job on ``device_type``."""
    swaps: dict[Any, Any] = {}
    for name in _SUMMED:
        original = getattr(dist, name, None)
        if original is not None:
            swaps[original] = _scaled(original, name)
    for name in ("isend", "send"):
        swaps[getattr(dist, name)] = mailbox.sending(getattr(dist, name), gloo=device_type == "cpu")
    for name in ("irecv", "recv"):
        swaps[getattr(dist, name)] = mailbox.receiving(getattr(dist, name))
    swaps[dist.broadcast_object_list] = _keep_local_objects
    if device_type == "cpu":
        swaps[dist.get_backend] = _backend_as(dist.get_backend, "gloo")
    return swaps


@contextlib.contextmanager
def fake_world(world_size: int, rank: int, device_type: str = "cpu") -> Iterator[Mailbox]:
    """Rank ``rank`` of a fake ``world_size``-rank world for the block (its mailbox: see :class:`Mailbox`);
    the process group is destroyed after."""
    saved = os.environ.get("DEEPSHARD_SHM")
    os.environ["DEEPSHARD_SHM"] = "0"  # shared memory needs real peers on this host
    start(world_size, rank)
    mailbox = Mailbox()
    try:
        with swapped(replacements(device_type, mailbox)):
            yield mailbox
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if saved is None:
            os.environ.pop("DEEPSHARD_SHM", None)
        else:
            os.environ["DEEPSHARD_SHM"] = saved
