"""CommGroup's pairwise (isend/irecv) reduce-scatter and all-gather against gloo's own collectives."""
from __future__ import annotations

import pytest

from tests.multiproc.harness import run_world
from tests.multiproc.scenarios_comm import collectives_agree


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pairwise_collectives_match_native(world: int, dtype: str) -> None:
    # the sum's rounding: an ulp per addition in fp32, one rounding in bf16 (summed in fp32); native
    # gloo sums bf16 in bf16, so against it allow a few ulps of its own rounding
    exact_tol = 2 ** -23 if dtype == "float32" else 2 ** -8
    native_tol = 1e-5 if dtype == "float32" else 0.1
    for r, res in enumerate(run_world(collectives_agree, world, dtype)):
        assert res["backend"] == "gloo"
        assert res["rs_exact"], f"rank {r}: reduce-scatter of rank+1 is not N(N+1)/2"
        assert res["rs_vs_exact"] <= exact_tol * (world - 1), f"rank {r}: {res}"
        assert res["rs_vs_native"] <= native_tol, f"rank {r}: {res}"
        assert res["rs_own_vs_native"] <= native_tol, f"rank {r}: {res}"
        assert res["ag_expected"] and res["ag_equal_native"] and res["ag_inplace"], f"rank {r}: {res}"


@pytest.mark.parametrize("world,pairwise", [(2, True), (3, True), (4, True), (3, False)])
def test_reduce_scatter_pieces_matches_the_concatenation(world: int, pairwise: bool) -> None:
    from tests.multiproc.scenarios_comm import pieces_reduce

    sizes = [5, 1, 37, 0, 12]  # 55 elements: pieces cross chunk borders, one is empty
    chunk = -(-55 // world) + 1  # a padded tail on the last rank
    for r, res in enumerate(run_world(pieces_reduce, world, sizes, chunk, "float32", pairwise)):
        assert res["shape_ok"], f"rank {r}: {res}"
        assert res["err"] <= 1e-5, f"rank {r}: {res}"
