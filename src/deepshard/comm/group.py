"""A communication group: one torch.distributed process group plus the counters for its collectives.

Every collective the library issues goes through a ``CommGroup`` so that bytes are counted (the comms
logger) and a world of size 1 needs no process group at all. Groups are objects passed to whoever needs
them: there is no module-level process-group state, so several engines can live in one process.

Volumes are recorded by the ZeRO paper's accounting (``CommsLogger``): an all-reduce moves 2x its
tensor, an all-gather or reduce-scatter 1x the full (unsharded) tensor.
"""
from __future__ import annotations

import os
import zlib
from typing import Any, Optional

import torch
import torch.distributed as dist

import deepshard.comm.pairwise as pairwise
import deepshard.comm.nodes as node_map
from deepshard.comm.logger import CommsLogger
from deepshard.comm.nodes import NodeMap
from deepshard.comm.settings import mode_from, slot_bytes_from
from deepshard.comm.transport import Transport, choose_transport, padded_concat
from deepshard.comm.watchdog import Watchdog

Work = Optional[dist.Work]

PAIRWISE_MAX_RANKS = 64
"""The largest gloo group that uses the pairwise forms by default (see ``CommGroup``): a dry run of a tiny
GPT at ZeRO-3 spent 0.03 s of CPU per step at 2 ranks and 10 s at 4,096 issuing the exchanges."""


class _DoneWork:
    """Stands in for an async handle when nothing was sent (world size 1)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class WatchedWork:
    """An async handle whose plain ``wait()`` goes through the group's watchdog, so a collective that
    never completes (a rank that diverged or vanished) ends with a diagnosis instead of hanging. A
    ``wait(timeout=...)`` is passed through (the watchdog itself calls it); other attributes too."""

    def __init__(self, work: Any, watchdog: Watchdog, what: str) -> None:
        self._work, self._watchdog, self._what = work, watchdog, what

    def wait(self, timeout: Any = None) -> bool:
        if timeout is not None:
            return self._work.wait(timeout=timeout)
        self._watchdog.wait(self._work, self._what)
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CommGroup:
    """Collectives over ``group`` (None = the default world group), counted by ``logger``.

    How the data moves is the group's ``transport``, chosen once here (``comm/transport.py``):

    ``pairwise``: run reduce-scatter and all-gather as direct ``isend``/``irecv`` exchanges
    (``comm/pairwise.py``) instead of the backend's own collectives. None (the default) chooses them
    on gloo, whose native ones are 2-3x slower and copy the whole input, for groups of at most
    :data:`PAIRWISE_MAX_RANKS` ranks; NCCL keeps its own. A pairwise collective issues 2(N-1) messages
    from Python on every rank, so beyond that size the issuing alone (a Python loop over the peers on every
    collective) costs more per step than gloo's native algorithms, which loop in C++.

    ``shm``: run those pairwise reduce-scatters and all-gathers through shared memory when every rank of
    the group is on this host (``comm/shm.py``); None (the default) reads ``DEEPSHARD_SHM`` (auto, 1 or
    0; auto uses it wherever it can). Groups spanning hosts keep TCP, and so do groups spanning the nodes
    of ``nodes`` (faked nodes on one host, network namespaces): their traffic must take the links between
    nodes, as it would between machines.

    ``nodes``: which ranks share a machine (``comm/nodes.py``); None reads the launcher's environment
    (one node when it says nothing). The logger splits this group's bytes by it.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, logger: Optional[CommsLogger] = None,
                 pairwise: Optional[bool] = None, name: str = "world", solo: bool = False,
                 shm: Optional[bool] = None, nodes: Optional[NodeMap] = None) -> None:
        self.group = group
        self.name = name
        self.logger = logger if logger is not None else CommsLogger()
        if solo:  # a group of this rank alone: no process group, every collective is local
            self.rank, self.size = 0, 1
            initialized = dist.is_available() and dist.is_initialized()
            self.backend = str(dist.get_backend()) if initialized else "none"
            self.peers = [dist.get_rank() if initialized else 0]
        elif dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
            self.backend = str(dist.get_backend(group))
            self.peers = [dist.get_global_rank(group, r) if group is not None else r for r in range(self.size)]
        else:
            self.rank, self.size, self.backend = 0, 1, "none"
            self.peers = [0]
        self.pairwise = (self.backend == "gloo" and self.size <= PAIRWISE_MAX_RANKS) if pairwise is None \
            else bool(pairwise)
        self._seq = 0  # tags of the pairwise collectives: the same sequence on every rank
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.nodes = nodes if nodes is not None else (node_map.from_env(world) or NodeMap.single(world))
        me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.shares = self.nodes.shares(me, self.peers)
        """``(intra, inter)``: the fractions of a collective's volume on links within / between nodes."""
        self.shm = mode_from(shm, os.environ) is not False and self.nodes.same_node(self.peers)
        """Whether the transport may use shared memory (asked for, and every peer on this rank's node)."""
        self._watchdog: Optional[Watchdog] = None
        self.transport: Transport = choose_transport(
            self.group, self.backend, self.rank, self.peers, self.pairwise, self.shm,
            self._next_tag, self.name, lambda: slot_bytes_from(os.environ), lambda: self.watchdog.limit)
        self.progress: Any = None
        """What the watchdog reads the training step from (``global_steps``): the owning engine's state."""

    @property
    def watchdog(self) -> Watchdog:
        """This group's collective watchdog (one sequence of collectives per group)."""
        if self._watchdog is None:
            self._watchdog = Watchdog(self)
        return self._watchdog

    def wait(self, work: Any, what: str) -> None:
        """Wait for ``work`` under the watchdog: a hang or a lost peer becomes a ``CollectiveTimeout``."""
        self.watchdog.wait(work, what)

    def _settle(self, work: Any, async_op: bool, what: str) -> Any:
        """The watched handle (async), or wait for it here under the watchdog (sync). NCCL keeps its
        own handles: a timed wait would block the host, and NCCL has its own watchdog."""
        if self.backend == "nccl":
            if async_op:
                return work
            work.wait()
            return None
        if async_op:
            return WatchedWork(work, self.watchdog, what)
        self.watchdog.wait(work, what)
        return None

    def _what(self, op: str, tensor: torch.Tensor) -> str:
        return f"{op} of {tensor.numel()} {str(tensor.dtype).replace('torch.', '')} elements over {self.size} ranks"

    @classmethod
    def single(cls, logger: Optional[CommsLogger] = None, name: str = "single") -> "CommGroup":
        """This rank alone (an axis of size 1): collectives are local copies or no-ops."""
        return cls(group=None, logger=logger, name=name, solo=True)

    def _record(self, op: str, elements: int, element_size: int, volume_factor: float = 1.0) -> None:
        """Count a collective under ``op`` (``_label``), split by link (``shares``)."""
        self.logger.record(self._label(op), elements, element_size, volume_factor, group_size=self.size,
                           shares=self.shares)

    def _label(self, op: str) -> str:
        """The comms logger's key: tensor- and pipeline-parallel traffic is counted apart from data
        parallel (``tp:all_reduce``); the world and dp groups keep the plain names."""
        return op if self.name in ("world", "dp", "seq_dp", "single") else f"{self.name}:{op}"

    def pairwise_for(self, tensor: torch.Tensor) -> bool:
        """Whether a collective on ``tensor`` runs as pairwise exchanges (whose result may land in its input)."""
        return self.transport.pairwise_for(tensor)

    def _next_tag(self, key: int, nbytes: int, count: int = 1) -> int:
        """The tag (first of ``count``) of the next pairwise collective: the group's sequence number mixed
        with what the collective is (``key``: e.g. a ZeRO-3 group's index; ``nbytes``: its size). Ranks
        that issue different collectives at the same point (rank-asymmetric code) then use different
        tags, so their messages never meet: they wait, and the watchdog names where each rank is,
        instead of gloo aborting the process on a size mismatch or silently exchanging the wrong data."""
        self._seq = (self._seq + count) % pairwise.TAG_MODULUS
        return zlib.crc32(f"{self._seq}:{key}:{nbytes}".encode()) % pairwise.TAG_MODULUS

    # ----------------------------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False,
                   op: dist.ReduceOp = dist.ReduceOp.SUM):
        """Sum ``tensor`` in place over the group."""
        if self.size == 1:
            return _DoneWork() if async_op else None
        self._record("all_reduce", tensor.numel(), tensor.element_size(), 2.0)
        work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        return self._settle(work, async_op, self._what("all_reduce", tensor))

    def all_gather_into_tensor(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                               key: int = 0):
        """Concatenate each rank's equally-sized ``shard`` into ``output`` (rank order). ``key`` names
        what is gathered (see ``_next_tag``)."""
        if self.size == 1:
            output.copy_(shard.reshape(output.shape))
            return _DoneWork() if async_op else None
        self._record("all_gather", output.numel(), output.element_size())
        what = self._what("all_gather", output)
        return self._settle(self.transport.all_gather(output, shard, key, what), async_op, what)

    def all_gather_inplace(self, buffer: torch.Tensor, async_op: bool = False):
        """Fill every chunk of ``buffer`` (N equal chunks) from its rank; chunk ``rank`` already holds
        this rank's values. No copy of the chunk is made."""
        if self.size == 1:
            return _DoneWork() if async_op else None
        mine = buffer.reshape(self.size, -1)[self.rank]
        if not self.transport.pairwise_for(buffer) and self.backend != "nccl":
            mine = mine.clone()  # in-place is NCCL's documented case; other native backends get a private input
        return self.all_gather_into_tensor(buffer, mine, async_op=async_op)

    def all_to_all_single(self, output: torch.Tensor, data: torch.Tensor, async_op: bool = False):
        """Send row ``k`` of ``data`` (``size`` equal rows) to rank ``k``; receive rank ``k``'s row for this
        rank into row ``k`` of ``output``. Counted as ``all_to_all`` (1x the tensor)."""
        if self.size == 1:
            output.copy_(data)
            return _DoneWork() if async_op else None
        self._record("all_to_all", data.numel(), data.element_size())
        what = self._what("all_to_all", data)
        return self._settle(self.transport.all_to_all(output, data, what), async_op, what)

    def reduce_scatter_tensor(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = False):
        """Sum ``full`` over ranks and leave this rank's equal slice in ``output``."""
        if self.size == 1:
            output.copy_(full.reshape(output.shape))
            return _DoneWork() if async_op else None
        self._record("reduce_scatter", full.numel(), full.element_size())
        what = self._what("reduce_scatter", full)
        return self._settle(self.transport.reduce_scatter(output, full, what), async_op, what)

    def reduce_scatter_pieces(self, pieces: list[torch.Tensor], chunk: int, key: int = 0) -> Any:
        """Start reducing the concatenation of the 1-D ``pieces`` (zero-padded to ``size * chunk``); the
        returned work's ``result`` is this rank's reduced chunk after ``wait()``. Pairwise transports send
        the pieces as they are; torch's own collective gets them copied into one staging buffer."""
        if not pieces:
            raise ValueError("reduce_scatter_pieces needs at least one tensor")
        dtype = pieces[0].dtype
        if any(p.dim() != 1 or not p.is_contiguous() or p.dtype != dtype for p in pieces):
            raise ValueError("reduce_scatter_pieces: pieces must be 1-D, contiguous and of one dtype")
        if self.size == 1:  # the result is the padded concatenation itself
            flat = padded_concat(pieces, chunk)
            return pairwise.CollectiveWork([], lambda: flat)
        self._record("reduce_scatter", chunk * self.size, pieces[0].element_size())
        what = (f"reduce_scatter of {chunk * self.size} {str(dtype).replace('torch.', '')} elements"
                f" over {self.size} ranks")
        return self._settle(self.transport.reduce_scatter_pieces(pieces, chunk, self.size, key, what), True, what)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """Broadcast from group rank ``src``."""
        if self.size == 1:
            return _DoneWork() if async_op else None
        self._record("broadcast", tensor.numel(), tensor.element_size())
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        work = dist.broadcast(tensor, src=global_src, group=self.group, async_op=True)
        return self._settle(work, async_op, self._what(f"broadcast from rank {src}", tensor))

    def all_reduce_control(self, tensor: torch.Tensor, what: str, op: str = "sum", label: str | None = None) -> None:
        """Reduce a small ``tensor`` in place (``op``: "sum" or "max") for the library's own bookkeeping:
        barriers, overflow flags, norms, save agreements. On pairwise groups it is a tagged exchange
        (``pairwise.all_reduce_small``), so a rank that reaches it while another rank is in a different
        collective (a rank-dependent ``save_checkpoint``) waits, and the watchdog names both positions,
        instead of gloo aborting the process on a size mismatch. ``label``: the comms logger's key
        (None: not counted, as for barriers)."""
        if self.size == 1:
            return
        if label is not None:
            self._record(label, tensor.numel(), tensor.element_size(), 2.0)
        self._settle(self.transport.all_reduce_small(tensor, op, what), False, what)

    def barrier(self, what: str = "barrier") -> None:
        """Wait for every rank (under the watchdog; ``what`` names the barrier in its diagnosis)."""
        if self.size > 1:
            self.all_reduce_control(torch.zeros(1, dtype=torch.float32, device=self._device()), what)

    # ------------------------------------------------------------------------------------- helpers
    def all_reduce_max_flag(self, flag: bool) -> bool:
        """True when ``flag`` is true on any rank (used for fp16 overflow agreement)."""
        if self.size == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float32, device=self._device())
        self.all_reduce_control(t, "all_reduce of the overflow flag", op="max", label="all_reduce(flag)")
        return bool(t.item() > 0)

    def all_reduce_sum_scalar(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a 0-d/1-element tensor over ranks; returns a new tensor."""
        if self.size == 1:
            return value
        t = value.detach().clone().reshape(1)
        self.all_reduce_control(t, "all_reduce of a scalar", label="all_reduce(scalar)")
        return t.reshape(value.shape)

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Broadcast a small picklable Python object (only ever our own metadata, never loaded files)."""
        if self.size == 1:
            return obj
        box = [obj]
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        dist.broadcast_object_list(box, src=global_src, group=self.group)
        return box[0]

    def _device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
