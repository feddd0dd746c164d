"""The pure parts of node awareness, hybrid sharding and ZeRO++: the node map from launchers' environments,
the block codec's error bound, the groups' rank arithmetic and the plan check's entries. No process group."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from deepshard.comm.nodes import NodeMap, detect, from_env
from deepshard.comm.quantize import BlockCodec
from deepshard.plan import Plan, check
from deepshard.topology import ParallelDims
from deepshard.zero.hierarchy import ZeroPlusPlus, block_rank_lists, hybrid_rank_lists, node_rank_lists


@pytest.mark.parametrize("env,expected,source", [
    ({"DEEPSHARD_NODE_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, (0, 0, 1, 1), "DEEPSHARD_NODE_SIZE"),
    ({"LOCAL_WORLD_SIZE": "2"}, (0, 0, 1, 1), "LOCAL_WORLD_SIZE"),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, (0, 1, 2, 3), "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ({"CROSS_SIZE": "2"}, (0, 0, 1, 1), "CROSS_SIZE"),  # DeepSpeed's launcher: the number of nodes
    ({"GROUP_WORLD_SIZE": "4"}, (0, 1, 2, 3), "GROUP_WORLD_SIZE"),
    ({"SLURM_NTASKS_PER_NODE": "2(x2)"}, (0, 0, 1, 1), "SLURM_NTASKS_PER_NODE"),
])
def test_node_map_from_launcher_environment(env: dict[str, str], expected: tuple[int, ...], source: str) -> None:
    found = from_env(4, env)
    assert found is not None and found.node_of == expected and found.source == source


def test_node_map_fallbacks_and_errors() -> None:
    assert from_env(4, {}) is None
    assert detect(4, env={}).node_of == (0, 0, 0, 0)  # nothing said, no collective: one machine
    keys = ["host:b", "host:a", "host:b", "host:a"]
    assert detect(4, gather=lambda key: keys, env={}).node_of == (0, 1, 0, 1)
    # network namespaces share a host name; torch elastic's GROUP_RANK tells the nodes apart
    seen: list[str] = []
    detect(2, gather=lambda key: seen.append(key) or [key, key], env={"GROUP_RANK": "1"})
    assert seen == ["group-rank:1"]
    assert from_env(4, {"LOCAL_WORLD_SIZE": "3"}) is None  # does not divide: not trusted
    with pytest.raises(ValueError, match="DEEPSHARD_NODE_SIZE=3 does not divide the world size 4"):
        from_env(4, {"DEEPSHARD_NODE_SIZE": "3"})
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='x' is not an integer"):
        from_env(4, {"LOCAL_WORLD_SIZE": "x"})


def test_node_map_shares_of_a_collective() -> None:
    nodes = NodeMap.blocks(8, 4, "test")
    # rank 1 in the world: 3 peers on its machine, 4 on the other, out of 8 parts
    assert nodes.shares(1, list(range(8))) == (3 / 8, 4 / 8)
    assert nodes.shares(1, [0, 1, 2, 3]) == (3 / 4, 0.0)
    assert nodes.shares(1, [1, 5]) == (0.0, 1 / 2)
    assert nodes.shares(1, [1]) == (0.0, 0.0)
    assert nodes.same_node([4, 7]) and not nodes.same_node([3, 4])
    assert nodes.by_node([0, 4, 1, 5]) == [[0, 1], [4, 5]]


@pytest.mark.parametrize("bits", [8, 4])
def test_block_codec_error_is_within_half_a_step(bits: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10_001, generator=g) * torch.linspace(0.01, 10, 10_001)  # blocks of very different scales
    codec = BlockCodec.spread(x.numel(), 1000, bits)
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.nbytes
    assert codec.nbytes == codec.padded * bits // 8 + 4 * codec.blocks
    y = codec.decode(payload)
    padded = torch.zeros(codec.padded)
    padded[:x.numel()] = x
    half_step = (padded.view(codec.blocks, -1).abs().amax(1) / codec.qmax / 2).repeat_interleave(codec.block)
    assert torch.all((y - x).abs() <= half_step[:x.numel()] * (1 + 1e-5))
    zeros = BlockCodec.spread(100, 64, bits)
    assert torch.equal(zeros.decode(zeros.encode(torch.zeros(100))), torch.zeros(100))


def test_block_codec_spreads_blocks_and_refuses_bad_shapes() -> None:
    assert BlockCodec.spread(8001, 8000, 8).block == 4002  # two even blocks, not 8000 + 1
    assert BlockCodec.spread(10, 8000, 8).blocks == 1
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        BlockCodec(10, 10, 2)
    with pytest.raises(ValueError, match="payload must be"):
        BlockCodec(10, 10, 8).decode(torch.zeros(3, dtype=torch.uint8))


def test_hybrid_and_secondary_rank_lists() -> None:
    shards, replicas = hybrid_rank_lists([[0, 1, 2, 3, 4, 5, 6, 7]], 4)
    assert shards == [[0, 1, 2, 3], [4, 5, 6, 7]] and replicas == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # with tensor parallelism the replicas of one slice stride by tp: each slice is split on its own
    shards, replicas = hybrid_rank_lists([[0, 2, 4, 6], [1, 3, 5, 7]], 2)
    assert shards == [[0, 2], [4, 6], [1, 3], [5, 7]] and replicas == [[0, 4], [2, 6], [1, 5], [3, 7]]
    with pytest.raises(ValueError, match="mics_shard_size=3 does not divide the 8 data-parallel ranks"):
        hybrid_rank_lists([list(range(8))], 3)
    assert block_rank_lists([list(range(8))], 2, "hpz") == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_node_rank_lists() -> None:
    nodes = NodeMap.blocks(8, 4, "test")
    intra, inter, split = node_rank_lists([list(range(8))], nodes)  # type: ignore[misc]
    assert intra == [[0, 1, 2, 3], [4, 5, 6, 7]] and inter == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert split == [[[0, 1, 2, 3], [4, 5, 6, 7]]]
    assert node_rank_lists([[0, 1, 4]], nodes) is None  # 2 ranks on one machine, 1 on the other
    assert node_rank_lists([[0, 4, 1, 5]], nodes) is None  # not numbered machine by machine


def _plan(stage: int = 3, dp: int = 4, **zero: Any) -> Plan:
    keys = {"mics_shard_size": -1, "mics_hierarchical_params_gather": False, "zero_hpz_partition_size": 1,
            "zero_quantized_weights": False, "zero_quantized_nontrainable_weights": False,
            "zero_quantized_gradients": False, **zero}
    settings = ZeroPlusPlus.from_config(SimpleNamespace(**keys))
    return Plan(dims=ParallelDims(dp=dp), stage=stage, zeropp=settings if settings.any else None)


@pytest.mark.parametrize("plan,message", [
    (_plan(stage=0, mics_shard_size=2), "mics_shard_size=2 with zero_optimization.stage=0"),
    (_plan(mics_shard_size=3), "mics_shard_size=3 on 4 data-parallel ranks"),
    (_plan(stage=2, zero_quantized_weights=True, zero_hpz_partition_size=2),
     "zero_hpz_partition_size and zero_quantized_weights with zero_optimization.stage=2"),
    (_plan(stage=0, zero_quantized_gradients=True), "zero_quantized_gradients with zero_optimization.stage=0"),
    (_plan(mics_shard_size=2, zero_hpz_partition_size=2), "zero_hpz_partition_size=2 with mics_shard_size=2"),
    (_plan(zero_hpz_partition_size=3), "zero_hpz_partition_size=3 on 4 ranks"),
])
def test_plan_check_refuses_what_cannot_combine(plan: Plan, message: str) -> None:
    conflicts = check(plan)
    assert len(conflicts) == 1 and message in str(conflicts[0]), conflicts


def test_plan_check_accepts_the_combinations_that_are_built() -> None:
    for plan in (_plan(zero_hpz_partition_size=2, zero_quantized_weights=True, zero_quantized_gradients=True),
                 _plan(stage=1, mics_shard_size=2), _plan(stage=2, zero_quantized_gradients=True),
                 _plan(mics_shard_size=4, mics_hierarchical_params_gather=True, zero_quantized_gradients=True)):
        assert check(plan) == []
