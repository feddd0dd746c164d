"""CommGroup's shared-memory all-gather and reduce-scatter (``comm/shm.py``): bit-identical to the pairwise
TCP path and to a reference summed locally in the same order, in fp32/bf16/fp16, over worlds of 2, 3 and 4
ranks and the dp groups of a 2x2 grid, with tensors several slots long; TCP kept when the ranks are on
different hosts; a peer that never arrives and mismatched collectives raise naming the ranks; nothing is
left in /dev/shm. One world per size runs every check."""
from __future__ import annotations

import os
from typing import Any

import pytest

from tests.multiproc.harness import run_world
from tests.multiproc.scenarios_shm import DTYPES, every_shm_check


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"world{w}")
def world(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    size = request.param
    return size, run_world(every_shm_check, size, size == 4, size == 2, timeout=300)


def test_shm_collectives_are_bit_identical(world: tuple[int, list[dict[str, Any]]]) -> None:
    size, results = world
    for r, res in enumerate(results):
        for group in ("world", "dp") if size == 4 else ("world",):
            got = res[group]
            assert got["used_shm"], f"rank {r} {group}: the shared-memory transport was not used"
            for dtype in DTYPES:
                for check in ("rs_pieces_vs_tcp", "rs_pieces_vs_ref", "rs_tensor", "all_gather"):
                    assert got[f"{dtype}:{check}"], f"rank {r} {group} {dtype}: {check} differs"


def test_shm_falls_back_to_tcp_across_hosts(world: tuple[int, list[dict[str, Any]]]) -> None:
    _, results = world
    for r, res in enumerate(results):
        fb = res["fallback"]
        assert fb["fell_back"], f"rank {r}: ranks on different hosts still used shared memory"
        assert all(v for k, v in fb.items() if k != "fell_back"), f"rank {r}: {fb}"


def test_shm_leaves_nothing_in_dev_shm(world: tuple[int, list[dict[str, Any]]]) -> None:
    _, results = world
    paths = {p for res in results for g in ("world", "dp") if g in res for p in res[g]["paths"]}
    assert paths and all(res["leftover"] == [] for res in results)
    assert not [p for p in paths if os.path.exists(p)]


def test_shm_timeout_and_mismatch_name_the_ranks(world: tuple[int, list[dict[str, Any]]]) -> None:
    size, results = world
    if size != 2:
        pytest.skip("checked in the 2-rank world")
    late = results[0]["timeout"]
    assert "all_gather of 4 float32 elements over 2 ranks" in late and "Rank(s) [1] did not arrive" in late, late
    assert "did not complete within 3s (DEEPSHARD_TIMEOUT=0.05 minutes)" in late, late
    assert "rank(s) [1] issued a different collective" in results[0]["mismatch"]
    assert "reduce_scatter" in results[1]["mismatch"] and "rank(s) [0]" in results[1]["mismatch"]
