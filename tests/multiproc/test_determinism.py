"""Bitwise determinism (docs/determinism.md).

Stage invariance: ZeRO stages 0, 1, 2 and 3, with and without optimizer offload, at one data-parallel
size, give the same parameters, losses and gradient norms bit for bit (fp32, and bf16 with fp32 masters),
with clipping active; the reduced gradient is the canonical sum over ranks of each rank's own gradient,
computed independently in one process. Worlds of 3 (an averaging factor that is not a power of two) and
4 (a two-level tree) each run every case once.

Layout invariance (``"deterministic": true``): one global batch of 4 micro-batches trained as dp=1 x
accumulation 4, dp=2 x 2 and dp=4 x 1 gives the same fp32 parameters at every stage, with and without
optimizer offload, and a run saved at dp=2 halfway and resumed at dp=4 ends where the others do. The dp=4
runs share the stage-invariance world of 4.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.multiproc.harness import run_world
from tests.multiproc.models import make_transformer
from tests.multiproc.scenarios_determinism import LAYOUT_VARIANTS, VARIANTS, layout_world, stage_world


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    """Rank 0's results of every world: 1 and 2 (the deterministic layouts; 2 also saves halfway), then
    3 and 4 (stage invariance; 4 also the dp=4 layouts and the resume from the dp=2 checkpoints)."""
    root = str(tmp_path_factory.mktemp("determinism"))
    out: dict[int, Any] = {w: run_world(layout_world, w, root, timeout=600)[0] for w in (1, 2)}
    out[3] = run_world(stage_world, 3, timeout=900)
    out[4] = run_world(stage_world, 4, root, timeout=900)
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_reduced_gradient_is_the_canonical_sum(worlds: dict[int, Any], world: int) -> None:
    assert all(r["reduced"][0] and r["reduced"][3] for r in worlds[world])


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_stage_gives_the_same_bits(worlds: dict[int, Any], world: int, dtype: str) -> None:
    results = worlds[world][0]
    base = results[(dtype, 0, "none")]
    assert max(base["norms"]) > 0.05  # clipping was active
    for stage, offload in VARIANTS[1:]:
        got = results[(dtype, stage, offload)]
        where = f"{dtype}, ZeRO {stage}, offload {offload}"
        assert got["losses"] == base["losses"], where
        assert got["norms"] == base["norms"], where
        for name, value in base["params"].items():
            assert torch.equal(got["params"][name], value), f"{where}: {name}"


def test_deterministic_layouts_give_the_same_bits(worlds: dict[int, Any]) -> None:
    """dp=1 x 4, 2 x 2, 4 x 1 and the dp 2 -> 4 resume: max |dtheta| == 0 at every stage and across stages."""
    runs = {"dp1 x 4": worlds[1], "dp2 x 2": worlds[2], "dp4 x 1": worlds[4][0]["layouts"]}
    reference = worlds[1][LAYOUT_VARIANTS[0]]
    start = dict(make_transformer().named_parameters())
    assert any(not torch.equal(v, start[n]) for n, v in reference.items())  # the runs trained
    for variant in LAYOUT_VARIANTS:
        cases = {label: r[variant] for label, r in runs.items()}
        cases["dp2 -> dp4 resume"] = runs["dp4 x 1"][variant + ("resumed",)]
        for label, params in cases.items():
            for name, value in reference.items():
                assert torch.equal(params[name], value), f"ZeRO {variant[0]}, offload {variant[1]}, {label}: {name}"
