"""Pipeline parallelism against single-process PyTorch (scenarios_pipe.py): one 2-process world (pp=2 under
every schedule, ZeRO 0/1/2, several micro-batch counts, recomputation, bf16/fp16, the engine's refusals, a
checkpoint resumed on pp=2 and pp=1 x dp=2) and one 4-process world (DeepSpeed's mpu()/topology() of a
PipelineModule before initialize, pp=2 x dp=2 and pp=4 under each
schedule, a (2, 2) checkpoint resumed on (4, 1) and (1, 4) and back)."""
from __future__ import annotations

from pathlib import Path

from tests.multiproc.harness import run_world
from tests.multiproc.scenarios_pipe import CONFIGS_2, CONFIGS_4, pp2_world, pp_dp_world


def test_pp2_matches_single_process_and_resumes_on_other_grids(tmp_path: Path) -> None:
    results = run_world(pp2_world, 2, str(tmp_path), timeout=400)
    assert results[0] == results[1]
    assert len(results[0]) == len(CONFIGS_2) + 4 + 1 + 1 + 2 and results[0][-2:] == ["pp2", "pp1"]  # 4 mixed precision, in-place, errors


def test_pp2_dp2_and_pp4_match_single_process_and_resume_across_grids(tmp_path: Path) -> None:
    results = run_world(pp_dp_world, 4, str(tmp_path), timeout=400)
    assert all(r == results[0] for r in results) and len(results[0]) == len(CONFIGS_4) + 3
    assert results[0][-2:] == ["pp4-and-back", "pp1-and-back"]
