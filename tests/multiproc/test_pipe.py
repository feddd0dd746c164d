"""Pipeline parallelism against single-process PyTorch (scenarios_pipe.py): pp=2 in one 2-process world,
pp=2 x dp=2 and pp=4 in one 4-process world; the engine's refusals."""
from __future__ import annotations

from tests.multiproc.harness import run_world
from tests.multiproc.scenarios_pipe import CONFIGS_2, errors_world, pp2_world, pp_dp_world


def test_pp2_matches_single_process_under_every_schedule_and_zero_stage() -> None:
    results = run_world(pp2_world, 2, timeout=240)
    assert results[0] == results[1] and len(results[0]) == len(CONFIGS_2)


def test_pp2_dp2_and_pp4_match_single_process() -> None:
    results = run_world(pp_dp_world, 4, timeout=300)
    assert all(r == results[0] for r in results) and len(results[0]) == 6


def test_pipeline_engine_refusals() -> None:
    assert run_world(errors_world, 2, timeout=120) == [["ok"], ["ok"]]
