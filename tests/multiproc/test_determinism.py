"""Bitwise determinism (docs/determinism.md). Stage invariance: ZeRO stages 0, 1, 2 and 3, with and
without optimizer offload, at one data-parallel size, give the same parameters, losses and gradient
norms bit for bit (fp32, and bf16 with fp32 masters), with clipping active; the reduced gradient is the
canonical sum over ranks of each rank's own gradient, computed independently in one process. Worlds of
3 (an averaging factor that is not a power of two) and 4 (a two-level tree) each run every case once."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.multiproc.harness import run_world
from tests.multiproc.scenarios_determinism import VARIANTS, stage_world


@pytest.fixture(scope="module", params=[3, 4], ids=lambda w: f"world{w}")
def stages(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return run_world(stage_world, request.param, timeout=900)


def test_reduced_gradient_is_the_canonical_sum(stages: list[dict[str, Any]]) -> None:
    assert all(r["reduced"][0] and r["reduced"][3] for r in stages)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_stage_gives_the_same_bits(stages: list[dict[str, Any]], dtype: str) -> None:
    results = stages[0]
    base = results[(dtype, 0, "none")]
    assert max(base["norms"]) > 0.05  # clipping was active
    for stage, offload in VARIANTS[1:]:
        got = results[(dtype, stage, offload)]
        where = f"{dtype}, ZeRO {stage}, offload {offload}"
        assert got["losses"] == base["losses"], where
        assert got["norms"] == base["norms"], where
        for name, value in base["params"].items():
            assert torch.equal(got["params"][name], value), f"{where}: {name}"
