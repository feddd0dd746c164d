"""World size 1, every capability, on the device the suite was started for: ``pytest --device cuda``
on a GPU machine (NCCL), ``--device cpu`` to try the same checks here. Skipped without ``--device``:
the 2- and 4-process tests already cover all of this on the CPU."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.multiproc.device import ENV
from tests.multiproc.harness import run_world
from tests.multiproc.models import make_batches, reference_run, rel_err
from tests.multiproc.scenarios_world1 import OFFLOAD_CASES, world1

pytestmark = pytest.mark.skipif(
    not os.environ.get(ENV), reason="device checks: run with --device cuda (or --device cpu)")

BF16_RTOL, FP16_RTOL = 3e-2, 5e-3


def fp32_rtol(device: str) -> float:
    """The CPU reference to round-off; on a GPU other kernels (and the order of their sums) differ."""
    return 1e-6 if device == "cpu" else 1e-4


@pytest.fixture(scope="module")
def world(tmp_path_factory: Any) -> dict[str, Any]:
    return run_world(world1, 1, str(tmp_path_factory.mktemp("world1")), timeout=600)[0]


def _matches(got: tuple[list[float], dict], ref: tuple[list[float], dict], rtol: float) -> None:
    losses, weights = got
    ref_losses, ref_weights = ref
    assert len(losses) == len(ref_losses) > 0
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= rtol * abs(b), f"step {i}: loss {a} vs reference {b}"
    assert set(weights) == set(ref_weights)
    for name, value in ref_weights.items():
        err = rel_err(weights[name], value.float())
        assert err <= rtol, f"{name}: relative error {err:.3g} > {rtol}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_and_precision_matches_single_process_torch(world: dict[str, Any], stage: int) -> None:
    results, tol = world["oracle"][stage], fp32_rtol(world["device"])
    ref = reference_run(make_batches(5, 8), clip=0.5)
    splits = [k for k in results if k.startswith("fp32_")]
    # micro 1, 2, 4 with 8, 4, 2 accumulation steps (stage 0 adds its reduce-after-backward schedule)
    assert {"fp32_m1_g8", "fp32_m2_g4", "fp32_m4_g2"} <= set(splits), splits
    for key in splits:
        _matches(results[key], ref, tol)
    sgd_ref = reference_run(make_batches(5, 8), clip=0.5, sgd=True)
    for key in (k for k in results if k.startswith("sgd_")):
        _matches(results[key], sgd_ref, tol)
    _matches(results["bf16"], ref, BF16_RTOL)
    _matches(results["fp16"], ref, FP16_RTOL)
    assert results["rank_spread"] == 0.0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_checkpoint_resume_is_bit_exact(world: dict[str, Any], dtype: str) -> None:
    r = world["checkpoint"][dtype]
    assert r["resumed"] == r["full"]
    for name, value in r["w_full"].items():
        assert torch.equal(value, r["w_resumed"][name]), name
    assert r["latest"] == "global_step3" and r["global_steps"] == 6


@pytest.mark.parametrize("case", [c[:3] for c in OFFLOAD_CASES], ids=lambda c: f"{c[0]}-stage{c[1]}-{c[2]}")
def test_offload_reproduces_the_run_without_offload(world: dict[str, Any], case: tuple[str, int, str]) -> None:
    ref, got = world["offload"][case]
    # on the CPU the same update on the same values; on a GPU the offloaded update runs on the host, and a
    # master weight one rounding apart can round to another bf16 value
    rtol = fp32_rtol(world["device"]) if world["device"] == "cpu" or case[2] == "fp32" else BF16_RTOL
    _matches(got, ref, rtol)


def test_one_stage_pipeline_matches_reference(world: dict[str, Any]) -> None:
    assert world["pipeline"] == "pp1-1f1b-z0-m2"  # checked against the reference inside the rank


def test_ran_on_the_requested_device(world: dict[str, Any]) -> None:
    assert world["device"] == os.environ[ENV]
