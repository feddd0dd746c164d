"""The groups a ZeRO strategy shards and communicates over when the machine boundary matters: MiCS /
hybrid sharding and ZeRO++ (hpZ, qwZ, qgZ), from DeepSpeed's keys.

- **Hybrid sharding** (MiCS, ``mics_shard_size = S``; PyTorch FSDP2's hybrid shard): within the ranks that
  hold replicas of one model slice (``Topology.seq_dp``, ``N`` ranks), consecutive blocks of ``S`` ranks
  are *shard* groups (parameters, gradients and optimizer states are partitioned over ``S``), and the
  ranks at the same place of every block are *replica* groups (``N / S`` copies of each shard).
  Gradients are reduce-scattered inside the shard group, then all-reduced across the replica group.
  With ``S`` = the ranks of one machine, every parameter gather stays inside it.
  ``mics_hierarchical_params_gather``: a shard group spanning several machines gathers across them
  first, then inside each (``comm/hierarchical.py``).
- **hpZ** (``zero_hpz_partition_size = H``): consecutive blocks of ``H`` ranks of the shard group hold a
  *secondary* shard each (``1/H`` of the parameters, kept from the forward gather), so backward's gathers
  (and the forwards of later micro-batches of the step) stay inside the block: inside one machine when
  ``H`` is its number of ranks (Wang et al. 2023, "ZeRO++").
- **qwZ** (``zero_quantized_weights``): parameter gathers send 8-bit blocks (``comm/quantize.py``).
- **qgZ** (``zero_quantized_gradients``): gradients are reduce-scattered as 4-bit blocks in two
  all-to-all hops, inside the machine, then across (``comm/hierarchical.py``), summed in fp32.

The rank arithmetic is plain functions (tested with no process group); :func:`build` makes the groups
(a collective: every rank calls it with the same config, through ``topology.new_groups``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from deepshard.comm.group import CommGroup
from deepshard.comm.hierarchical import Hierarchy
from deepshard.comm.nodes import NodeMap
from deepshard.topology import Topology, new_groups
from deepshard.utils.logging import logger
from deepshard.zero.grad_comm import GradReduce

QGZ_BITS = 4
"""qgZ's width: DeepSpeed's (its kernels quantize both hops to 4 bits)."""


@dataclass(frozen=True)
class ZeroPlusPlus:
    """What the config asks for (``zero_optimization`` keys, DeepSpeed's names and defaults)."""

    mics_shard_size: int = -1
    mics_hierarchical_params_gather: bool = False
    hpz_partition_size: int = 1
    quantized_weights: bool = False
    quantized_nontrainable_weights: bool = False
    quantized_gradients: bool = False
    gradient_bits: int = QGZ_BITS

    @classmethod
    def from_config(cls, zcfg: Any) -> "ZeroPlusPlus":
        return cls(mics_shard_size=int(zcfg.mics_shard_size),
                   mics_hierarchical_params_gather=bool(zcfg.mics_hierarchical_params_gather),
                   hpz_partition_size=max(int(zcfg.zero_hpz_partition_size), 1),
                   quantized_weights=bool(zcfg.zero_quantized_weights),
                   quantized_nontrainable_weights=bool(zcfg.zero_quantized_nontrainable_weights),
                   quantized_gradients=bool(zcfg.zero_quantized_gradients))

    @property
    def hybrid(self) -> bool:
        return self.mics_shard_size > 0

    @property
    def any(self) -> bool:
        """Whether anything differs from plain ZeRO."""
        return (self.hybrid or self.hpz_partition_size > 1 or self.quantized_weights
                or self.quantized_nontrainable_weights or self.quantized_gradients)


@dataclass(frozen=True)
class ZeroGroups:
    """This rank's groups (see the module docstring). ``shard``: where ZeRO partitions (the strategy's
    ``comm``); ``replica``: across which shards are copies (one rank without hybrid sharding); ``hpz``: the
    secondary-shard group (None without hpZ); ``hierarchy``: ``shard`` split by machine (None when it
    cannot be: machines holding different numbers of its ranks, or ranks not numbered machine by machine)."""

    settings: ZeroPlusPlus
    shard: CommGroup
    replica: CommGroup
    hpz: Optional[CommGroup] = None
    hierarchy: Optional[Hierarchy] = None

    def grad_reduce(self) -> GradReduce:
        """The gradient reduction of the dense parameters (``zero/grad_comm.py``)."""
        bits = self.settings.gradient_bits if self.settings.quantized_gradients else None
        return GradReduce(self.shard, self.replica if self.replica.size > 1 else None,
                          self.hierarchy if bits is not None else None, bits)

    def describe(self) -> dict[str, Any]:
        """What a checkpoint records of the layout (for the reader's messages; loading needs none of it)."""
        return {"shard_size": self.shard.size, "replicas": self.replica.size,
                "hpz_partition_size": self.hpz.size if self.hpz is not None else 1,
                "quantized_weights": self.settings.quantized_weights,
                "quantized_gradients": self.settings.quantized_gradients}

    @property
    def hierarchical_gather(self) -> Optional[Hierarchy]:
        """The hierarchy parameter gathers go through (``mics_hierarchical_params_gather``), or None."""
        if self.settings.mics_hierarchical_params_gather and self.hierarchy is not None \
                and self.hierarchy.inter.size > 1:
            return self.hierarchy
        return None


# ------------------------------------------------------------------------------------ rank arithmetic
def hybrid_rank_lists(replica_sets: Sequence[Sequence[int]], shard_size: int
                      ) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replica groups) of every set of ``N`` replicas: consecutive blocks of ``shard_size``,
    and the ranks at the same place of each block."""
    shards: list[list[int]] = []
    replicas: list[list[int]] = []
    for ranks in replica_sets:
        n = len(ranks)
        if shard_size < 1 or n % shard_size:
            raise ValueError(f"zero_optimization.mics_shard_size={shard_size} does not divide the {n} data-parallel "
                             f"ranks that hold copies of the model: the shard groups are blocks of mics_shard_size "
                             f"ranks; use a divisor of {n} (e.g. the number of ranks per machine)")
        shards += [list(ranks[i:i + shard_size]) for i in range(0, n, shard_size)]
        replicas += [list(ranks[i::shard_size]) for i in range(shard_size)]
    return shards, replicas


def block_rank_lists(groups: Sequence[Sequence[int]], size: int, what: str) -> list[list[int]]:
    """Consecutive blocks of ``size`` ranks of every group (hpZ's secondary groups)."""
    out: list[list[int]] = []
    for ranks in groups:
        if size < 1 or len(ranks) % size:
            raise ValueError(f"{what}={size} does not divide the {len(ranks)} ranks the parameters are sharded "
                             f"over; use a divisor of {len(ranks)} (e.g. the number of ranks per machine)")
        out += [list(ranks[i:i + size]) for i in range(0, len(ranks), size)]
    return out


def node_rank_lists(groups: Sequence[Sequence[int]], nodes: NodeMap
                    ) -> Optional[tuple[list[list[int]], list[list[int]], list[list[list[int]]]]]:
    """(intra-node groups, inter-node groups, each group's ranks by node) of every group, or None when some
    group cannot be split evenly: machines holding different numbers of its ranks, or its ranks not
    numbered machine by machine (every launcher numbers them so)."""
    intra: list[list[int]] = []
    inter: list[list[int]] = []
    split: list[list[list[int]]] = []
    for ranks in groups:
        by_node = nodes.by_node(ranks)
        if len({len(n) for n in by_node}) != 1 or [r for n in by_node for r in n] != list(ranks):
            return None
        intra += by_node
        inter += [[n[j] for n in by_node] for j in range(len(by_node[0]))]
        split.append(by_node)
    return intra, inter, split


# -------------------------------------------------------------------------------------------- groups
def build(topology: Topology, settings: ZeroPlusPlus) -> ZeroGroups:
    """This rank's groups for ``settings`` (a collective: every rank calls it with the same settings)."""
    base = topology.seq_dp
    assert base is not None  # Topology.__post_init__
    replica_sets = topology.dims.group_ranks("seq_dp")
    if settings.hybrid and settings.mics_shard_size < base.size:
        shard_lists, replica_lists = hybrid_rank_lists(replica_sets, settings.mics_shard_size)
        shard = _group(topology, shard_lists, "shard")
        replica = _group(topology, replica_lists, "replica")
    else:
        if settings.hybrid:  # validated: a shard size of all the replicas is plain ZeRO
            hybrid_rank_lists(replica_sets, settings.mics_shard_size)
        shard_lists, shard = [list(r) for r in replica_sets], base
        replica = CommGroup.single(logger=topology.world.logger, name="replica")
    hpz = None
    if settings.hpz_partition_size > 1:
        hpz_lists = block_rank_lists(shard_lists, settings.hpz_partition_size, "zero_optimization.zero_hpz_partition_size")
        hpz = _group(topology, hpz_lists, "hpz")
        if not topology.nodes.same_node(hpz.peers):
            logger.warning("zero_hpz_partition_size=%d: the secondary-shard group %s spans machines (%s), so "
                           "backward's gathers cross the links between them; set it to the number of ranks per "
                           "machine", settings.hpz_partition_size, hpz.peers, topology.nodes.describe())
    hierarchy = None
    if settings.quantized_gradients or settings.mics_hierarchical_params_gather:
        hierarchy = _hierarchy(topology, shard, shard_lists)
    return ZeroGroups(settings, shard, replica, hpz, hierarchy)


def _hierarchy(topology: Topology, shard: CommGroup, shard_lists: list[list[int]]) -> Optional[Hierarchy]:
    split = node_rank_lists(shard_lists, topology.nodes)
    if split is None:
        logger.warning("the ranks of the ZeRO shard group %s are not spread evenly over machines, numbered machine "
                       "by machine (%s): quantized gradients take one hop over the whole group, and parameter "
                       "gathers are flat", shard.peers, topology.nodes.describe())
        split = ([list(r) for r in shard_lists], [[r] for ranks in shard_lists for r in ranks],
                 [[list(r)] for r in shard_lists])
    intra_lists, inter_lists, by_node = split
    intra = _group(topology, intra_lists, "intra")
    inter = _group(topology, inter_lists, "inter")
    mine = next(nodes for nodes in by_node if topology.rank in [r for n in nodes for r in n])
    return Hierarchy(shard, tuple(tuple(n) for n in mine), intra, inter)


def _group(topology: Topology, rank_lists: list[list[int]], name: str) -> CommGroup:
    """This rank's group of ``rank_lists`` (every rank calls it, in order; each creates its own): a local group when
    they are single ranks, the world group when one list holds every rank."""
    logger_ = topology.world.logger
    if all(len(r) == 1 for r in rank_lists):
        return CommGroup.single(logger=logger_, name=name)
    if len(rank_lists) == 1 and len(rank_lists[0]) == topology.dims.world_size:
        return CommGroup(group=None, logger=logger_, name=name, pairwise=topology.world.pairwise,
                         nodes=topology.nodes)
    own = new_groups(rank_lists, topology.rank, logger_, name, topology.world.pairwise, topology.nodes)
    if own is None:
        raise RuntimeError(f"rank {topology.rank} is in none of the {name} groups {rank_lists}")
    return own
