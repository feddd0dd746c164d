"""The sequence-parallel sub-groups of a grid: Ulysses (consecutive sp ranks) and ring (strided), for the
three modes. Created through ``topology.new_groups`` (every rank, same order; each creates its own groups only)."""
from __future__ import annotations

from typing import Literal, Optional

from deepshard.comm.group import CommGroup
from deepshard.sp.attention import SPGroups
from deepshard.topology import Topology, new_groups

Mode = Literal["ulysses", "ring", "hybrid"]


def build_sp_groups(topology: Topology, mode: Mode = "ulysses", ulysses_size: Optional[int] = None) -> SPGroups:
    """``topology``'s sp group split for ``mode`` (collective: every rank calls it with the same arguments)."""
    sp = topology.sp
    assert sp is not None
    logger = topology.world.logger
    if mode == "ulysses" or sp.size == 1:
        return SPGroups(sp=sp, ulysses=sp, ring=CommGroup.single(logger, "sp_ring"))
    if mode == "ring":
        return SPGroups(sp=sp, ulysses=CommGroup.single(logger, "sp_ulysses"), ring=sp)
    if mode != "hybrid":
        raise ValueError(f"sequence-parallel mode {mode!r}: use 'ulysses', 'ring' or 'hybrid'")
    u = ulysses_size or 0
    if u < 2 or sp.size % u != 0 or u == sp.size:
        raise ValueError(f"hybrid sequence parallelism needs ulysses_size, a divisor of sp={sp.size} strictly "
                         f"between 1 and {sp.size}; got {ulysses_size!r}")
    g = topology.dims.peers(topology.rank, "sp")  # this rank's sp group: only its own splits are created
    ulysses_lists = [g[i:i + u] for i in range(0, len(g), u)]
    ring_lists = [g[i::u] for i in range(u)]
    mine_u = new_groups(ulysses_lists, topology.rank, logger, "sp_ulysses", pairwise=topology.world.pairwise,
                        nodes=topology.world.nodes)
    mine_r = new_groups(ring_lists, topology.rank, logger, "sp_ring", pairwise=topology.world.pairwise,
                        nodes=topology.world.nodes)
    assert mine_u is not None and mine_r is not None
    return SPGroups(sp=sp, ulysses=mine_u, ring=mine_r)
