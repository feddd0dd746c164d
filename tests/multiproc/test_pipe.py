"""Pipeline parallelism against single-process PyTorch (scenarios_pipe.py): pp=2 in one 2-process world
(every schedule, ZeRO 0/1/2, several micro-batch counts, then the engine's refusals), pp=2 x dp=2 and
pp=4 in one 4-process world."""
from __future__ import annotations

from tests.multiproc.harness import run_world
from pathlib import Path

from tests.multiproc.scenarios_pipe import CONFIGS_2, CONFIGS_4, pp2_world, pp_dp_world, resume_world


def test_pp2_matches_single_process_under_every_schedule_and_zero_stage() -> None:
    results = run_world(pp2_world, 2, timeout=300)
    assert results[0] == results[1] and len(results[0]) == len(CONFIGS_2) + 3


def test_pp2_dp2_and_pp4_match_single_process() -> None:
    results = run_world(pp_dp_world, 4, timeout=300)
    assert all(r == results[0] for r in results) and len(results[0]) == len(CONFIGS_4)


def test_pipeline_checkpoint_resumes_on_other_stage_and_dp_counts(tmp_path: Path) -> None:
    assert run_world(resume_world, 2, str(tmp_path), timeout=200) == [["pp2", "pp1"], ["pp2", "pp1"]]
