"""CommGroup's pairwise (isend/irecv) reduce-scatter and all-gather against gloo's own collectives. One
world per size (2, 3, 4 processes) runs every check; the tests read its results."""
from __future__ import annotations

from typing import Any

import pytest

from tests.multiproc.harness import run_world
from tests.multiproc.scenarios_comm import every_comm_check


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"world{w}")
def world(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    size = request.param
    return size, run_world(every_comm_check, size, size == 3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pairwise_collectives_match_native(world: tuple[int, list[dict[str, Any]]], dtype: str) -> None:
    size, results = world
    # the sum's rounding: an ulp per addition in fp32, one rounding in bf16 (summed in fp32); native
    # gloo sums bf16 in bf16, so against it allow a few ulps of its own rounding
    exact_tol = 2 ** -23 if dtype == "float32" else 2 ** -8
    native_tol = 1e-5 if dtype == "float32" else 0.1
    for r, res in enumerate(out[dtype] for out in results):
        assert res["backend"] == "gloo"
        assert res["rs_exact"], f"rank {r}: reduce-scatter of rank+1 is not N(N+1)/2"
        assert res["rs_vs_exact"] <= exact_tol * (size - 1), f"rank {r}: {res}"
        assert res["rs_vs_native"] <= native_tol, f"rank {r}: {res}"
        assert res["rs_own_vs_native"] <= native_tol, f"rank {r}: {res}"
        assert res["ag_expected"] and res["ag_equal_native"] and res["ag_inplace"], f"rank {r}: {res}"


def test_reduce_scatter_pieces_matches_the_concatenation(world: tuple[int, list[dict[str, Any]]]) -> None:
    size, results = world
    kinds = ["pieces_pairwise=True"] + (["pieces_pairwise=False"] if size == 3 else [])
    for kind in kinds:
        for r, res in enumerate(out[kind] for out in results):
            assert res["shape_ok"], f"{kind} rank {r}: {res}"
            assert res["err"] <= 1e-5, f"{kind} rank {r}: {res}"
