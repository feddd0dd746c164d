"""3D parallelism: pipeline x data x tensor (2 x 2 x 2 on 8 processes) with ZeRO-1 and ZeRO-2, a GPT
written with the Megatron layers against the same model in plain PyTorch."""
from __future__ import annotations

from tests.multiproc.harness import run_world
from tests.multiproc.scenarios_tp_3d import three_d_world


def test_pp2_dp2_tp2_zero1_and_zero2_match_single_process() -> None:
    results = run_world(three_d_world, 8, timeout=600)
    for zero in (1, 2):
        for rank, per_stage in enumerate(results):
            res = per_stage[zero]
            assert res["loss"] <= 2e-5 and res["params"] <= 2e-5, f"ZeRO-{zero} rank {rank}: {res}"
            assert res["n_params"] > 0 and res["tp_traffic"] > 0, f"ZeRO-{zero} rank {rank}: {res}"
        assert [r[zero]["stage"] for r in results] == [0, 0, 0, 0, 1, 1, 1, 1]
