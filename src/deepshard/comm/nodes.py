"""Which ranks share a machine: the node map every group, the comms logger and the hierarchical ZeRO
collectives (MiCS, hpZ, qgZ) read.

Links inside a machine (shared memory, NVLink) are 5-20x faster than the links between machines, so
whether two ranks share one decides where a collective's bytes go. The map comes from the launcher's
environment, first match wins:

1. ``DEEPSHARD_NODE_SIZE=k``: consecutive blocks of ``k`` ranks are one node. A test override that fakes
   several nodes on one host (and the way to state the layout when a launcher sets nothing).
2. Ranks per node: ``LOCAL_WORLD_SIZE`` (torch elastic, ``torchrun``, deepshard's launcher),
   ``OMPI_COMM_WORLD_LOCAL_SIZE`` (Open MPI), ``MPI_LOCALNRANKS`` (MPICH), ``MV2_COMM_WORLD_LOCAL_SIZE``
   (MVAPICH), ``SLURM_NTASKS_PER_NODE``; or the number of nodes: ``GROUP_WORLD_SIZE`` (torch elastic),
   ``CROSS_SIZE`` (DeepSpeed's launcher), ``SLURM_STEP_NUM_NODES``/``SLURM_JOB_NUM_NODES``. Every one of
   these launchers numbers ranks node by node, so node ``i`` holds ranks ``i*k .. i*k+k-1``.
3. Otherwise, when the caller can run a collective (``Topology.build``), each rank's host name (or
   ``GROUP_RANK``, the node's rank under torch elastic), gathered from every rank.
4. Otherwise one node.

A map is plain data (a tuple of node indices), frozen, passed to whoever needs it: no module-level state.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

NODE_SIZE_VAR = "DEEPSHARD_NODE_SIZE"
RANKS_PER_NODE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                       "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")
NODE_COUNT_VARS = ("GROUP_WORLD_SIZE", "CROSS_SIZE", "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES")


@dataclass(frozen=True)
class NodeMap:
    """``node_of[r]``: the node (machine) of global rank ``r``, numbered in order of first rank."""

    node_of: tuple[int, ...]
    source: str = "default"
    """Where the map came from (the variable's name, ``hostname``, ``default``): said in logs and errors."""

    @classmethod
    def single(cls, world_size: int) -> "NodeMap":
        """Every rank on one machine."""
        return cls(tuple([0] * max(world_size, 1)), "default")

    @classmethod
    def blocks(cls, world_size: int, per_node: int, source: str) -> "NodeMap":
        """Consecutive blocks of ``per_node`` ranks (the last node may hold fewer)."""
        if per_node < 1:
            raise ValueError(f"{source}={per_node}: the number of ranks per node must be >= 1")
        return cls(tuple(r // per_node for r in range(world_size)), source)

    @classmethod
    def from_keys(cls, keys: Sequence[object], source: str) -> "NodeMap":
        """Ranks with equal ``keys`` (host names) share a node; nodes numbered by first appearance."""
        index: dict[object, int] = {}
        return cls(tuple(index.setdefault(k, len(index)) for k in keys), source)

    @property
    def world_size(self) -> int:
        return len(self.node_of)

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_of))

    def node(self, rank: int) -> int:
        """The node of global ``rank`` (rank 0's node for a rank outside the map: a world of one)."""
        return self.node_of[rank] if 0 <= rank < len(self.node_of) else self.node_of[0]

    def same_node(self, ranks: Sequence[int]) -> bool:
        """Whether every rank of ``ranks`` is on one node."""
        return len({self.node(r) for r in ranks}) <= 1

    def by_node(self, ranks: Sequence[int]) -> list[list[int]]:
        """``ranks`` split by node, each list in the given order, nodes in order of first appearance."""
        out: dict[int, list[int]] = {}
        for r in ranks:
            out.setdefault(self.node(r), []).append(r)
        return list(out.values())

    def shares(self, rank: int, peers: Sequence[int]) -> tuple[float, float]:
        """``(intra, inter)``: the fractions of a collective's volume that ``rank`` moves to peers on its own
        node and on other nodes, when it exchanges an equal part with each of the ``len(peers)`` group members
        (a direct exchange; the ZeRO volume of an all-gather or reduce-scatter is the whole tensor, of which
        ``1/n`` goes to each peer)."""
        n = len(peers)
        if n <= 1:
            return 0.0, 0.0
        mine = self.node(rank)
        same = sum(1 for p in peers if p != rank and self.node(p) == mine)
        other = sum(1 for p in peers if self.node(p) != mine)
        return same / n, other / n

    def describe(self) -> str:
        sizes = [self.node_of.count(n) for n in sorted(set(self.node_of))]
        return f"{self.num_nodes} node(s) of {sizes} ranks (from {self.source})"


def _positive(env: Mapping[str, str], name: str) -> Optional[int]:
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        number = int(value.split("(")[0])  # Slurm writes "2(x3)" for repeated counts
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer; fix or unset it") from None
    if number < 1:
        raise ValueError(f"environment variable {name}={value!r} must be a positive integer")
    return number


def from_env(world_size: int, env: Optional[Mapping[str, str]] = None) -> Optional[NodeMap]:
    """The node map the environment states (rules 1 and 2 of the module docstring), or None."""
    env = os.environ if env is None else env
    override = _positive(env, NODE_SIZE_VAR)
    if override is not None:
        if world_size % override != 0:
            raise ValueError(f"{NODE_SIZE_VAR}={override} does not divide the world size {world_size}: every "
                             f"faked node holds {override} ranks; set it to a divisor of {world_size}")
        return NodeMap.blocks(world_size, override, NODE_SIZE_VAR)
    for name in RANKS_PER_NODE_VARS:
        per_node = _positive(env, name)
        if per_node is not None and per_node <= world_size and world_size % per_node == 0:
            return NodeMap.blocks(world_size, per_node, name)
    for name in NODE_COUNT_VARS:
        nodes = _positive(env, name)
        if nodes is not None and nodes <= world_size and world_size % nodes == 0:
            return NodeMap.blocks(world_size, world_size // nodes, name)
    return None


def host_key(env: Optional[Mapping[str, str]] = None) -> str:
    """This process's machine, as rule 3 compares it: torch elastic's ``GROUP_RANK`` (network namespaces on
    one host share a host name but are distinct nodes to the agents), else the host name."""
    env = os.environ if env is None else env
    group_rank = env.get("GROUP_RANK")
    return f"group-rank:{group_rank}" if group_rank not in (None, "") else f"host:{socket.gethostname()}"


def detect(world_size: int, gather: Optional[Callable[[str], list[str]]] = None,
           env: Optional[Mapping[str, str]] = None) -> NodeMap:
    """The node map of a world of ``world_size`` ranks. ``gather(key)``, when given, returns every rank's
    ``key`` in rank order (a collective: ``Topology.build`` passes one); without it a world whose environment
    says nothing is one node."""
    found = from_env(world_size, env)
    if found is not None:
        return found
    if gather is not None and world_size > 1:
        return NodeMap.from_keys(gather(host_key(env)), "hostname")
    return NodeMap.single(world_size)
