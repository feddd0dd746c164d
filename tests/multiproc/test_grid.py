"""The process grid on several processes: a 2 x 2 x 2 grid's groups (8 processes), a Megatron-style
``mpu`` (dp=2 x tp=2) trained at stages 0-3 against single-process PyTorch with the checkpoint loaded on
dp=4, and engines created and destroyed 50 times."""
from __future__ import annotations

from typing import Any

import pytest

from deepshard.topology import ParallelDims
from tests.multiproc.harness import run_world
from tests.multiproc.models import make_batches, reference_run, rel_err
from tests.multiproc.scenarios_grid import GLOBAL_BATCH, destroy_cycles, engine_seams, grid_groups, mpu_world


def test_2x2x2_grid_groups_on_8_processes() -> None:
    results = run_world(grid_groups, 8)
    dims = ParallelDims(2, 2, 2)
    for rank, out in enumerate(results):
        c = dims.coord(rank)
        assert out["coord"] == (c.pp, c.dp, c.tp)
        for axis in ("dp", "tp", "pp", "model_parallel"):
            peers, group_rank, total = out[axis]
            assert peers == dims.peers(rank, axis)
            assert group_rank == peers.index(rank)
            assert total == sum(peers)  # the collective ran over exactly these ranks
    assert "tp:all_reduce" in results[0]["labels"] and "pp:all_reduce" in results[0]["labels"]


@pytest.fixture(scope="module")
def mpu_results(tmp_path_factory: Any) -> list[dict[int, Any]]:
    return run_world(mpu_world, 4, str(tmp_path_factory.mktemp("mpu")), timeout=400)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mpu_dp2_tp2_matches_single_process_and_loads_on_dp4(mpu_results: list, stage: int) -> None:
    ref_losses, ref_weights = reference_run(make_batches(5, GLOBAL_BATCH), clip=0.5)
    for out in mpu_results:
        result = out[stage]
        for a, b in zip(result["losses"], ref_losses):
            assert abs(a - b) <= 1e-6 * abs(b), (result["losses"], ref_losses)
        for name, value in ref_weights.items():
            assert rel_err(result["weights"][name], value.float()) <= 1e-6, name
        assert result["reload_err"] == 0.0
        assert result["global_steps"] == 5


def test_mpu_dataloader_shards_by_data_parallel_rank(mpu_results: list) -> None:
    by_dp: dict[int, list[int]] = {}
    for out in mpu_results:  # the two tp ranks of one dp index see the same samples
        assert by_dp.setdefault(out["loader"]["dp_rank"], out["loader"]["ids"]) == out["loader"]["ids"]
    assert sorted(by_dp) == [0, 1]
    assert sorted(by_dp[0] + by_dp[1]) == list(range(16))  # two disjoint halves of the data set


def test_fifty_create_destroy_cycles_leave_nothing_behind() -> None:
    for out in run_world(destroy_cycles, 1, timeout=400):  # "in one process"
        assert out["alive"] == 0, "destroyed engines are still referenced"
        assert out["leftovers"] == 0, "hooks or parameter ownership survived destroy()"
        assert out["fds_after"] <= out["fds_before"], out


def test_engine_seams_guarded_optimizer_two_engines_v1_checkpoint(tmp_path: Any) -> None:
    for out in run_world(engine_seams, 2, str(tmp_path)):
        assert "Call engine.step() after engine.backward(loss) instead" in out["direct_step"], out["direct_step"]
        assert out["grads_after_zero_grad"] == 0.0
        assert out["owners"] == (True, True)
        assert out["after_destroy"] == (True, True)
        assert out["v1_reload_err"] == 0.0 and out["v1_steps"] == 1
