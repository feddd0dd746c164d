"""Offload's default sub-group and staging sizes: derived from the shard and the host memory when the
config leaves them out (so the staging pool stays a small fraction of the states it moves off the
device), taken as given otherwise, and said in the log. No process group."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import pytest
import torch

from deepshard.config import load_config
from deepshard.utils.logging import logger
from deepshard.zero.offload.factory import make_shard_states
from deepshard.zero.offload.policy import AioSettings, NvmeOffload, make_offload_policies
from deepshard.zero.offload.sizing import MIN_SUB_GROUP, SHARD_FRACTION, plan_staging
from deepshard.zero.offload.states import StatesSpec
from deepshard.zero.partition import Fragment

GiB = 2**30


def test_defaults_cut_the_shard_into_small_sub_groups() -> None:
    shard = 200_000_000  # a 400M-parameter model on 2 processes
    plan = plan_staging(shard, True, 20 * GiB, 2, None, None)
    assert plan.buffer_count == 6 and plan.sub_group_size == shard // SHARD_FRACTION
    states_bytes = 12 * shard  # fp32 master weights + Adam's two states, kept off the device
    assert plan.pool_bytes <= states_bytes / 32
    assert "sub_group_size 3,125,000 (1/64" in plan.reason and "buffer_count 6" in plan.reason


def test_defaults_respect_the_memory_available() -> None:
    plan = plan_staging(10**9, True, 1 * GiB, 4, None, None)
    assert plan.pool_bytes <= 1 * GiB // (16 * 4)


def test_small_shards_use_one_sub_group_and_fp32_needs_no_masters() -> None:
    small = plan_staging(1000, True, 8 * GiB, 1, None, None)
    assert small.sub_group_size == 1000  # the log says why, without contradicting "at least 262,144"
    assert "sub_group_size 1,000 (the whole 1,000-element shard: smaller than the 262,144-element minimum" in small.reason
    plan = plan_staging(3 * MIN_SUB_GROUP, False, 8 * GiB, 1, None, None)
    assert plan.sub_group_size == MIN_SUB_GROUP and plan.buffer_count == 4
    assert "the 262,144-element minimum: 1/64 of the 786,432-element shard is smaller" in plan.reason
    tight = plan_staging(10**9, True, 1 * GiB, 4, None, None)
    assert "as large as the host-memory limit below allows" in tight.reason


def test_given_values_are_used_as_given() -> None:
    plan = plan_staging(10**8, True, 8 * GiB, 1, 10**9, 4)  # DeepSpeed's defaults written out
    assert (plan.sub_group_size, plan.buffer_count, plan.reason) == (10**9, 4, "both given in the config")
    plan = plan_staging(10**8, True, 8 * GiB, 1, 5000, None)
    assert plan.sub_group_size == 5000 and plan.buffer_count == 6


def test_policy_keeps_only_the_values_the_config_gives(tmp_path: Path) -> None:
    def policy(zero: dict) -> NvmeOffload:
        cfg = load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3, **zero}}, dp_world_size=1)
        return make_offload_policies(cfg.zero_optimization, cfg.aio, "cpu")[0]  # type: ignore[return-value]

    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    left_out = policy({"offload_optimizer": nvme})
    assert left_out.sub_group_size is None and left_out.buffer_count is None
    auto = policy({"offload_optimizer": nvme, "sub_group_size": "auto"})
    assert auto.sub_group_size is None
    given = policy({"offload_optimizer": {**nvme, "buffer_count": 3}, "sub_group_size": 1e9})
    assert given.sub_group_size == 10**9 and given.buffer_count == 3


@pytest.fixture
def info_logged() -> Iterator[list[str]]:
    messages: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = _Keep(logging.DEBUG)
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


def _spec(numel: int) -> StatesSpec:
    return StatesSpec([Fragment("w", 0, 0, numel, 0, 0)], numel, torch.device("cpu"), True, None, 0)


def test_states_built_with_defaults_stage_a_fraction_of_the_shard(tmp_path: Path, info_logged: list[str]) -> None:
    numel = 4 * MIN_SUB_GROUP
    states = make_shard_states(NvmeOffload(path=tmp_path, aio=AioSettings()), _spec(numel))
    try:
        assert len(states.subgroups) == 4  # type: ignore[attr-defined]
        assert states.pool.count == 6 and states.pool.nbytes == MIN_SUB_GROUP * 4  # type: ignore[attr-defined]
    finally:
        states.close()
    assert any(m.startswith(f"zero_optimization.offload_optimizer (nvme): sub-groups of {MIN_SUB_GROUP:,} "
                            "elements, 6 staging buffer(s)") for m in info_logged)
    states = make_shard_states(NvmeOffload(path=tmp_path, aio=AioSettings(), sub_group_size=10**9, buffer_count=4),
                               _spec(numel))
    try:
        assert len(states.subgroups) == 1 and states.pool.count == 4  # type: ignore[attr-defined]
        assert states.pool.nbytes == numel * 4  # type: ignore[attr-defined]
    finally:
        states.close()


# ------------------------------------------------------------------------------ the gradient shard
@pytest.mark.parametrize("mapped", [False, True], ids=["staged", "mapped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_shard_on_disk_gives_the_resident_bits(tmp_path: Path, dtype: torch.dtype, mapped: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same reduce sequence (two micro-batches, one group getting no gradient the first time)
    leaves the same values, pieces and norm on disk as in memory; zero_ starts over."""
    from deepshard.zero.offload.backing import FileBacking
    from deepshard.zero.offload.grad_store import OffloadedGradShard, ResidentGradShard
    from deepshard.zero.offload.swapper import AsyncSwapper
    from deepshard.zero.sharded_optimizer import squared_norm

    ranges = [(0, 40), (40, 25), (65, 35)]
    chunk = 16  # the norm's chunks straddle the ranges, as NORM_CHUNK does in a real shard
    monkeypatch.setattr("deepshard.zero.sharded_optimizer.NORM_CHUNK", chunk)
    from deepshard.zero.offload.mapped import MappedFileBacking
    kind = MappedFileBacking if mapped else FileBacking
    backing = kind(AsyncSwapper(tmp_path, 0, AioSettings(block_size=64, queue_depth=2, thread_count=2)))
    disk = OffloadedGradShard(backing, 100, dtype, torch.device("cpu"), ranges, chunk)
    mem = ResidentGradShard(100, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    try:
        for micro, groups in enumerate(([0, 2], [2, 1, 0])):
            for gi in groups:
                start, numel = ranges[gi]
                values = torch.randn(numel, generator=gen).to(dtype)
                for store in (disk, mem):
                    store.accumulate(start, values.clone(), 0.5 if micro else 1.0)
            spans = [(3, 30), (40, 25), (90, 10)]
            assert all(torch.equal(a, b) for a, b in zip(disk.pieces(spans), mem.pieces(spans)))
            cpu = torch.device("cpu")
            assert torch.equal(squared_norm(disk.norm_sources(), cpu), squared_norm(mem.norm_sources(), cpu))
        assert mem.nbytes() == 100 * mem.tensor.element_size() and disk.nbytes() == 0
        for store in (disk, mem):
            store.zero_()
        assert torch.equal(disk.pieces([(0, 100)])[0], torch.zeros(100, dtype=dtype))
    finally:
        backing.close()
