"""The process grid: pipeline x data x sequence x tensor parallel, as pure rank arithmetic and as process groups.

Rank order follows DeepSpeed (``PipeModelDataParallelTopology``, and its sequence-parallel groups of
consecutive ranks) and Megatron: tensor-parallel fastest, pipeline slowest, so tensor-parallel peers are
neighbours (one node), sequence-parallel peers next, and a pipeline neighbour is ``dp * sp * tp`` ranks away::

    rank = pipe * (dp * sp * tp) + data * (sp * tp) + seq * tp + model

``ParallelDims`` is the arithmetic alone (unit-tested with no process group). ``Topology`` holds one
``CommGroup`` per axis for this rank; ``Topology.build`` creates, on every rank and in one fixed order,
this rank's group of each axis only, through :func:`own_group`, the only caller of ``dist.new_group`` in
deepshard (only a group's members create it: one group creation per axis per rank at any world size).

Groups:

- ``world``: every rank.
- ``dp``: ranks that read different samples (same pipe, sequence and tensor coordinates). Batch sizes
  and the dataloader count these.
- ``sp``: ranks that split one sample's sequence (same pipe, data and tensor coordinates):
  ``deepshard.sp`` (Ulysses, ring attention) exchanges activations here.
- ``seq_dp``: ranks that hold the same model slice, dp x sp (same pipe and tensor coordinates; DeepSpeed's
  "sequence data parallel" group). ZeRO shards and reduces here, and only here: a sequence-parallel rank
  is one more replica of the weights. It is the ``dp`` group itself when sp is 1.
- ``tp``: ranks that split one layer's matrices (same pipe, data and sequence coordinates).
- ``pp``: the stages of one pipeline (same data, sequence and tensor coordinates).
- ``model_parallel``: ranks of one replica (same data and sequence coordinates, pp x tp). A gradient
  norm or an overflow flag is combined over ``seq_dp`` first, then here.

Expert parallelism (mixture-of-experts layers, ``deepshard.moe``) divides the replicas of ``seq_dp``
further, per expert-parallel size ``P`` (``ParallelDims.expert_group_ranks``, DeepSpeed's layout): the
*expert-parallel* groups are consecutive blocks of ``P`` replicas (tokens are exchanged there by
all-to-all; each rank holds ``1/P`` of a layer's experts) and the *expert-data-parallel* groups stride
by ``P`` (the ranks holding the same experts: expert gradients are reduced and ZeRO-sharded there).
``Topology.with_experts`` adds them, named ``ep_size_<P>`` as DeepSpeed names them.

Node awareness: ``Topology.nodes`` (``deepshard.comm.nodes.NodeMap``) says which ranks share a machine,
read from the launcher's environment when the topology is built; every group of the topology knows it
(its comms logger splits bytes into intra-node and inter-node), and the hierarchical ZeRO groups
(``deepshard.zero_groups``: MiCS / hybrid sharding, ZeRO++'s hpZ and qgZ) are cut along it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Mapping, Optional, Sequence

import deepshard.comm.nodes as node_map
from deepshard.comm.group import CommGroup
from deepshard.comm.logger import CommsLogger
from deepshard.comm.nodes import NodeMap

Axis = Literal["pp", "dp", "tp", "model_parallel", "sp", "seq_dp"]
AXES: tuple[Axis, ...] = ("dp", "tp", "pp", "model_parallel", "sp", "seq_dp")
"""The order in which ``Topology.build`` creates groups (the same on every rank)."""


class TopologyError(ValueError):
    """A grid that does not fit the world: the message shows the arithmetic."""


@dataclass(frozen=True)
class Coord:
    """A rank's place in the grid."""

    pp: int
    dp: int
    tp: int
    sp: int = 0


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the four axes; their product is the world size."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    sp: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "sp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TopologyError(f"ParallelDims.{name} must be a positive integer, got {value!r}")

    @classmethod
    def for_world(cls, world_size: int, pp: int = 1, tp: int = 1, dp: Optional[int] = None,
                  sp: int = 1) -> "ParallelDims":
        """The grid for ``world_size`` ranks: ``dp`` is what is left after ``pp``, ``sp`` and ``tp`` unless given."""
        if world_size < 1:
            raise TopologyError(f"world size must be >= 1, got {world_size}")
        if pp < 1 or tp < 1 or sp < 1:
            raise TopologyError(f"pipeline ({pp}), sequence ({sp}) and tensor ({tp}) parallel sizes must be >= 1")
        if dp is None:
            rest = pp * sp * tp
            if world_size % rest != 0:
                raise TopologyError(
                    f"world size {world_size} is not divisible by pipeline x sequence x tensor = {pp} x {sp} x {tp} "
                    f"= {rest}: the data-parallel size would be {world_size} / {rest} = {world_size / rest:.3g}; "
                    f"launch a multiple of {rest} processes or change the pipeline/sequence/tensor sizes")
            dp = world_size // rest
        dims = cls(pp=pp, dp=dp, tp=tp, sp=sp)
        dims.check_world(world_size)
        return dims

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.sp * self.tp

    def check_world(self, world_size: int) -> None:
        """Raise unless ``pp * dp * sp * tp == world_size``, printing the product."""
        if self.world_size != world_size:
            raise TopologyError(
                f"the grid pipeline x data x sequence x tensor = {self.pp} x {self.dp} x {self.sp} x {self.tp} = "
                f"{self.world_size} ranks does not match the world size {world_size}; choose sizes whose product "
                f"is {world_size}")

    # ------------------------------------------------------------------------------ rank arithmetic
    def rank(self, coord: Coord) -> int:
        """The global rank at ``coord``."""
        for name, size in (("pp", self.pp), ("dp", self.dp), ("sp", self.sp), ("tp", self.tp)):
            value = getattr(coord, name)
            if not 0 <= value < size:
                raise TopologyError(f"coordinate {name}={value} is outside 0..{size - 1} in {self}")
        return ((coord.pp * self.dp + coord.dp) * self.sp + coord.sp) * self.tp + coord.tp

    def coord(self, rank: int) -> Coord:
        """The coordinate of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside 0..{self.world_size - 1} of {self}")
        rest, tp = divmod(rank, self.tp)
        rest, sp = divmod(rest, self.sp)
        pp, dp = divmod(rest, self.dp)
        return Coord(pp=pp, dp=dp, tp=tp, sp=sp)

    def group_ranks(self, axis: Axis) -> list[list[int]]:
        """Every group along ``axis`` as sorted global ranks; the same list on every rank.

        ``model_parallel`` groups the ranks sharing data and sequence coordinates (pp x tp); ``seq_dp`` the
        ranks sharing pipe and tensor coordinates (dp x sp)."""
        keys: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            c = self.coord(r)
            if axis == "dp":
                key = (c.pp, c.sp, c.tp)
            elif axis == "sp":
                key = (c.pp, c.dp, c.tp)
            elif axis == "seq_dp":
                key = (c.pp, c.tp)
            elif axis == "tp":
                key = (c.pp, c.dp, c.sp)
            elif axis == "pp":
                key = (c.dp, c.sp, c.tp)
            elif axis == "model_parallel":
                key = (c.dp, c.sp)
            else:
                raise TopologyError(f"unknown axis {axis!r}; use one of {AXES}")
            keys.setdefault(key, []).append(r)
        return [keys[k] for k in sorted(keys)]

    def expert_group_ranks(self, ep_size: int, data_before_expert: bool = False
                           ) -> tuple[list[list[int]], list[list[int]]]:
        """(expert-parallel groups, expert-data-parallel groups) for experts split over ``ep_size`` ranks,
        each a list of sorted global ranks, the same on every rank. Within every ``seq_dp`` group (the
        replicas of one model slice) the expert-parallel groups are consecutive blocks of ``ep_size``
        replicas and the expert-data-parallel groups take every ``ep_size``-th (DeepSpeed's default
        layout); ``data_before_expert`` (DeepSpeed's ``use_data_before_expert_parallelism``) swaps the
        two: expert-data-parallel blocks, expert-parallel strides."""
        ep_groups: list[list[int]] = []
        edp_groups: list[list[int]] = []
        for replicas in self.group_ranks("seq_dp"):
            n = len(replicas)
            if not isinstance(ep_size, int) or ep_size < 1 or n % ep_size != 0:
                raise TopologyError(
                    f"expert-parallel size {ep_size!r} does not divide the {n} data-parallel replicas of {self}: "
                    f"each expert-parallel group is ep_size replicas; choose an ep_size that divides {n}")
            blocks, strides = ep_size, n // ep_size
            if data_before_expert:
                edp_groups += [replicas[i * strides:(i + 1) * strides] for i in range(blocks)]
                ep_groups += [replicas[i::strides] for i in range(strides)]
            else:
                ep_groups += [replicas[i * blocks:(i + 1) * blocks] for i in range(strides)]
                edp_groups += [replicas[i::blocks] for i in range(blocks)]
        return ep_groups, edp_groups

    def peers(self, rank: int, axis: Axis) -> list[int]:
        """The global ranks of ``rank``'s group along ``axis``, sorted (from its coordinate: the work of one
        group, not of the whole grid)."""
        c = self.coord(rank)
        varying = {"dp": ("dp",), "sp": ("sp",), "tp": ("tp",), "pp": ("pp",), "seq_dp": ("dp", "sp"),
                    "model_parallel": ("pp", "tp")}.get(axis)
        if varying is None:
            raise TopologyError(f"unknown axis {axis!r}; use one of {AXES}")
        ranges = {name: range(getattr(self, name)) if name in varying else [getattr(c, name)]
                  for name in ("pp", "dp", "sp", "tp")}
        return sorted(self.rank(Coord(pp=p, dp=d, tp=t, sp=q))
                      for p in ranges["pp"] for d in ranges["dp"] for q in ranges["sp"] for t in ranges["tp"])

    def stage_rank(self, rank: int, stage: int) -> int:
        """The rank holding pipeline ``stage`` with ``rank``'s data, sequence and tensor coordinates."""
        c = self.coord(rank)
        return self.rank(Coord(pp=stage, dp=c.dp, tp=c.tp, sp=c.sp))

    def __str__(self) -> str:
        sp = f", sp={self.sp}" if self.sp > 1 else ""
        return f"grid(pp={self.pp}, dp={self.dp}{sp}, tp={self.tp})"


@dataclass(frozen=True)
class ExpertGroups:
    """The two groups of one expert-parallel size on this rank (DeepSpeed's ``ep_size_<P>`` pair)."""

    name: str
    """``ep_size_<P>``: the ``group_name`` DeepSpeed marks expert parameters with."""
    ep_size: int
    ep: CommGroup
    """The expert-parallel group: tokens are exchanged here by all-to-all."""
    edp: CommGroup
    """The expert-data-parallel group: ranks holding the same experts (gradients reduced, states sharded)."""
    ep_ranks: tuple[int, ...]
    edp_ranks: tuple[int, ...]

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert-parallel group: it holds experts ``ep_rank * local`` onwards."""
        return self.ep.rank


@dataclass(frozen=True)
class Topology:
    """This rank's groups of the grid. Built once by ``Topology.build`` (or ``Topology.single``)."""

    dims: ParallelDims
    rank: int
    coord: Coord
    world: CommGroup
    dp: CommGroup
    tp: CommGroup
    pp: CommGroup
    model_parallel: CommGroup
    sp: CommGroup
    """The sequence-parallel group (a one-rank group when sp is 1)."""
    seq_dp: CommGroup
    """dp x sp: where ZeRO shards and reduces (the ``dp`` group itself when sp is 1)."""
    experts: Mapping[str, ExpertGroups] = field(default_factory=dict)
    """Expert-parallel groups by name (``ep_size_<P>``), added by :meth:`with_experts`."""

    @classmethod
    def build(cls, dims: ParallelDims, logger: Optional[CommsLogger] = None) -> "Topology":
        """Create every group of the grid (collective: every rank calls it with the same ``dims``).

        An axis of size 1 needs no process group and an axis spanning the world reuses the default
        group, so a pure data-parallel grid creates no group at all (today's behaviour)."""
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size() if initialized else 1
        rank = dist.get_rank() if initialized else 0
        dims.check_world(world_size)
        logger = logger if logger is not None else CommsLogger()
        nodes = node_map.detect(world_size, _gather_keys if initialized and world_size > 1 else None)
        world = CommGroup(group=None, logger=logger, name="world", nodes=nodes)
        mine: dict[str, CommGroup] = {}
        for axis in AXES:
            if axis == "seq_dp" and dims.sp == 1:
                mine[axis] = mine["dp"]  # the same ranks: no second group
                continue
            mine[axis] = _axis_group(dims, axis, rank, world, logger)
        return cls(dims=dims, rank=rank, coord=dims.coord(rank), world=world, dp=mine["dp"], tp=mine["tp"],
                   pp=mine["pp"], model_parallel=mine["model_parallel"], sp=mine["sp"], seq_dp=mine["seq_dp"])

    @classmethod
    def from_groups(cls, dims: ParallelDims, rank: int, world: CommGroup, dp: CommGroup, tp: CommGroup,
                    pp: CommGroup, model_parallel: CommGroup, sp: Optional[CommGroup] = None,
                    seq_dp: Optional[CommGroup] = None, coord: Optional[Coord] = None) -> "Topology":
        """A topology over groups someone else made (a Megatron-style ``mpu``). Without sequence parallelism
        ``sp`` is a one-rank group and ``seq_dp`` the ``dp`` group; ``coord`` defaults to the rank's place in
        DeepSpeed's order."""
        if (sp is None or seq_dp is None) and dims.sp != 1:
            raise TopologyError(f"{dims} needs its sequence-parallel group (sp=...) and its data x sequence group "
                                "(seq_dp=...)")
        return cls(dims=dims, rank=rank, coord=coord if coord is not None else dims.coord(rank), world=world, dp=dp,
                   tp=tp, pp=pp, model_parallel=model_parallel,
                   sp=sp if sp is not None else CommGroup.single(logger=world.logger, name="sp"),
                   seq_dp=seq_dp if seq_dp is not None else dp)

    def with_experts(self, ep_sizes: Sequence[int], data_before_expert: bool = False) -> "Topology":
        """This topology plus the expert-parallel and expert-data-parallel groups of each of ``ep_sizes``
        (collective: every rank calls it with the same sizes in the same order; sizes it has already are
        kept). The expert-parallel group is always a process group of its own, even when it spans the
        world, so its all-to-alls never share a tag sequence with the gradient reductions running beside
        them; with ``ep_size`` 1 the expert-data-parallel group is ``seq_dp`` itself."""
        import torch.distributed as dist

        logger = self.world.logger
        found = dict(self.experts)
        for size in ep_sizes:
            name = f"ep_size_{size}"
            if name in found:
                continue
            ep_lists, edp_lists = self.dims.expert_group_ranks(size, data_before_expert)
            distributed = dist.is_available() and dist.is_initialized()
            nodes = self.world.nodes
            if size == 1:  # every rank holds every expert: nothing to exchange, reduced like the dense weights
                ep = (new_groups(ep_lists, self.rank, logger, "ep", self.world.pairwise, nodes) if distributed
                      else None)
                edp = self.seq_dp
            else:
                edp = new_groups(edp_lists, self.rank, logger, "edp", self.world.pairwise, nodes)
                ep = new_groups(ep_lists, self.rank, logger, "ep", self.world.pairwise, nodes)
            ep = ep if ep is not None else CommGroup.single(logger=logger, name="ep")
            if edp is None:  # unreachable: expert_group_ranks puts every rank in one group of each list
                raise TopologyError(f"rank {self.rank} is in no expert-data-parallel group of {edp_lists}")
            mine = next(ranks for ranks in ep_lists if self.rank in ranks)
            mine_edp = next(ranks for ranks in edp_lists if self.rank in ranks)
            found[name] = ExpertGroups(name, size, ep, edp, tuple(mine), tuple(mine_edp))
        return replace(self, experts=found)

    @property
    def nodes(self) -> NodeMap:
        """Which ranks share a machine (``deepshard.comm.nodes``)."""
        return self.world.nodes

    @property
    def is_data_parallel_only(self) -> bool:
        return self.dims.pp == 1 and self.dims.tp == 1 and self.dims.sp == 1

    def describe(self) -> str:
        return (f"{self.dims} rank {self.rank} at pp={self.coord.pp} dp={self.coord.dp} sp={self.coord.sp} "
                f"tp={self.coord.tp}")


def _axis_group(dims: ParallelDims, axis: Axis, rank: int, world: CommGroup, logger: CommsLogger) -> CommGroup:
    """This rank's group along ``axis``, as a counted ``CommGroup`` (only its members create it)."""
    mine = dims.peers(rank, axis)
    if len(mine) == 1:
        return CommGroup.single(logger=logger, name=axis)
    if len(mine) == dims.world_size:
        return CommGroup(group=None, logger=logger, name=axis, pairwise=world.pairwise, nodes=world.nodes)
    own = own_group(mine, rank, logger=logger, name=axis, nodes=world.nodes)  # its transport chosen by its own size
    if own is None:  # unreachable: peers() holds rank
        raise TopologyError(f"rank {rank} is not in its own {axis} group {mine}")
    return own


def own_group(mine: Optional[Sequence[int]], rank: int, logger: CommsLogger, name: str,
              pairwise: Optional[bool] = None, nodes: Optional[NodeMap] = None) -> Optional[CommGroup]:
    """Create this rank's group ``mine`` (its sorted global ranks; None: this rank is in none of this
    call's groups) and return it as a counted ``CommGroup`` (None for None). ``nodes``: which ranks share
    a machine (None: from the environment).

    The only caller of ``dist.new_group`` in deepshard (the grid's axes, the pipeline's tied-weight groups,
    sequence- and expert-parallel groups). Only the members of a group create it (torch's
    ``use_local_synchronization``): a rank takes part in one group creation per call, whatever the world
    size, instead of every group of every rank (N calls, each a barrier of the whole world through the
    store: O(N^2) store operations at start-up for Megatron-style grids). Collective in one sense still:
    every rank makes this call, in the same order, and a rank in no group creates a group of itself,
    because torch names a locally synchronized group by its ranks and by how many groups this process
    created before, which must therefore be the same on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return CommGroup.single(logger=logger, name=name) if mine is not None else None
    ranks = sorted(int(r) for r in mine) if mine is not None else [rank]
    if rank not in ranks:
        raise TopologyError(f"rank {rank} asked to create the {name} group {ranks}, which it is not in")
    group = dist.new_group(ranks=ranks, use_local_synchronization=True)
    if mine is None:
        return None
    return CommGroup(group=group, logger=logger, name=name, pairwise=pairwise, nodes=nodes)


def new_groups(rank_lists: Sequence[Sequence[int]], rank: int, logger: CommsLogger, name: str,
               pairwise: Optional[bool] = None, nodes: Optional[NodeMap] = None) -> Optional[CommGroup]:
    """This rank's group among ``rank_lists`` (disjoint lists; every rank calls it with the same lists, in
    the same order), created by :func:`own_group`; None when ``rank`` is in none."""
    mine = next((list(ranks) for ranks in rank_lists if rank in ranks), None)
    return own_group(mine, rank, logger, name, pairwise, nodes)


def _gather_keys(key: str) -> list[str]:
    """Every rank's ``key`` in rank order (a collective over the world: ``deepshard.comm.nodes.detect``)."""
    import torch.distributed as dist

    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, key)
    return [str(k) for k in out]


def ranks_of(group: CommGroup) -> Sequence[int]:
    """The global ranks of ``group`` (group order)."""
    return list(group.peers)
