"""The grid's rank arithmetic, with no process group (DeepSpeed/Megatron order: tensor fastest)."""
from __future__ import annotations

import itertools

import pytest

from deepshard.topology import AXES, Coord, ParallelDims, Topology, TopologyError

SIZES = [(pp, dp, tp, sp) for pp, dp, tp, sp in itertools.product(range(1, 9), repeat=4) if pp * dp * tp * sp <= 8]


def test_reference_layout_2x2x2() -> None:
    """REFERENCE_PARALLEL.md section 6, written out by hand."""
    dims = ParallelDims(pp=2, dp=2, tp=2)
    assert dims.group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.group_ranks("model_parallel") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert dims.coord(5) == Coord(pp=1, dp=0, tp=1)
    assert dims.stage_rank(2, 1) == 6  # next stage is rank + dp*tp


@pytest.mark.parametrize("pp,dp,tp,sp", SIZES)
def test_every_coordinate_and_group(pp: int, dp: int, tp: int, sp: int) -> None:
    dims = ParallelDims(pp=pp, dp=dp, tp=tp, sp=sp)
    n = pp * dp * tp * sp
    seen = set()
    for r in range(n):
        c = dims.coord(r)
        assert r == c.pp * dp * sp * tp + c.dp * sp * tp + c.sp * tp + c.tp
        assert dims.rank(c) == r
        seen.add((c.pp, c.dp, c.tp, c.sp))
    assert len(seen) == n
    sizes = {"pp": pp, "dp": dp, "tp": tp, "sp": sp, "model_parallel": pp * tp, "seq_dp": dp * sp}
    for axis in AXES:
        groups = dims.group_ranks(axis)
        assert sorted(r for g in groups for r in g) == list(range(n))  # a partition of the world
        assert all(len(g) == sizes[axis] for g in groups)
        for g in groups:
            coords = [dims.coord(r) for r in g]
            varying = {k for k in ("pp", "dp", "tp", "sp") if len({getattr(c, k) for c in coords}) > 1}
            allowed = {"pp": {"pp"}, "dp": {"dp"}, "tp": {"tp"}, "sp": {"sp"}, "model_parallel": {"pp", "tp"},
                       "seq_dp": {"dp", "sp"}}[axis]
            assert varying <= allowed
            if axis == "tp" and tp > 1:
                assert g == list(range(g[0], g[0] + tp))  # tensor-parallel peers are neighbours
            if axis in ("sp", "seq_dp") and tp == 1 and pp == 1 and axis == "sp":
                assert g == list(range(g[0], g[0] + sp))  # DeepSpeed's sp groups: consecutive ranks
        for r in range(n):
            assert r in dims.peers(r, axis)


def test_sequence_axis_layout_matches_deepspeed() -> None:
    """sp groups are consecutive ranks (DeepSpeed's parallel_state_sp); ZeRO's group is dp x sp."""
    dims = ParallelDims(dp=2, sp=2)
    assert dims.group_ranks("sp") == [[0, 1], [2, 3]]
    assert dims.group_ranks("dp") == [[0, 2], [1, 3]]
    assert dims.group_ranks("seq_dp") == [[0, 1, 2, 3]]
    assert dims.group_ranks("model_parallel") == [[0], [1], [2], [3]]
    assert dims.coord(3) == Coord(pp=0, dp=1, tp=0, sp=1)
    assert str(dims) == "grid(pp=1, dp=2, sp=2, tp=1)"
    assert ParallelDims.for_world(8, sp=4).dp == 2


def test_sequence_groups_with_tensor_parallelism_share_the_tensor_index() -> None:
    """dp=2 x sp=2 x tp=2: an sp group holds the ranks of one tensor index (the heads that rank holds), ZeRO's
    dp x sp group the ranks of one tensor index too; the tp pairs are consecutive."""
    dims = ParallelDims(dp=2, sp=2, tp=2)
    assert dims.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.group_ranks("sp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.group_ranks("seq_dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.group_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for group in dims.group_ranks("sp") + dims.group_ranks("seq_dp"):
        assert len({dims.coord(r).tp for r in group}) == 1, group


def test_for_world_derives_dp_and_prints_the_arithmetic() -> None:
    assert ParallelDims.for_world(8, pp=2, tp=2) == ParallelDims(2, 2, 2)
    assert ParallelDims.for_world(6, tp=3).dp == 2
    with pytest.raises(TopologyError, match=r"world size 6 is not divisible by pipeline x sequence x tensor = "
                                            r"2 x 1 x 2 = 4"):
        ParallelDims.for_world(6, pp=2, tp=2)
    with pytest.raises(TopologyError, match=r"2 x 2 x 1 x 1 = 4 ranks does not match the world size 8"):
        ParallelDims.for_world(8, pp=2, dp=2)
    with pytest.raises(TopologyError, match="positive integer"):
        ParallelDims(pp=0)
    with pytest.raises(TopologyError, match="outside"):
        ParallelDims(2, 2, 2).coord(8)


def test_single_process_topology_needs_no_process_group() -> None:
    topo = Topology.build(ParallelDims())
    assert topo.coord == Coord(0, 0, 0)
    assert topo.seq_dp is topo.dp and topo.sp is not None and topo.sp.size == 1
    for group in (topo.world, topo.dp, topo.tp, topo.pp, topo.model_parallel, topo.sp):
        assert group.size == 1 and group.rank == 0
    assert topo.world.logger is topo.tp.logger  # one logger, traffic labelled per group
    assert topo.tp._label("all_reduce") == "tp:all_reduce" and topo.dp._label("all_reduce") == "all_reduce"


def test_peers_is_the_group_holding_the_rank_without_building_the_grid() -> None:
    """``peers`` computes one rank's group from its coordinate (what ``Topology.build`` creates); it must be
    the group ``group_ranks`` lists for that rank, on every axis of several grids."""
    from deepshard.topology import AXES, ParallelDims

    for dims in (ParallelDims(pp=2, dp=3, tp=2), ParallelDims(pp=3, dp=2, tp=1, sp=2), ParallelDims(dp=5)):
        for axis in AXES:
            groups = dims.group_ranks(axis)
            for rank in range(dims.world_size):
                assert dims.peers(rank, axis) == next(g for g in groups if rank in g), (dims, axis, rank)
