"""torch.compile at every ZeRO stage against the uncompiled single-process reference, checkpoints keyed
by the original module's names whether the saving or the loading model was compiled, and (in the same
world) the ZeRO-3 error that points to set_z3_leaf_modules and activation checkpointing at stages 0-3."""
from __future__ import annotations

from typing import Any

import pytest

from tests.multiproc.harness import run_world
from tests.multiproc.models import make_batches, make_model, reference_run, rel_err
from tests.multiproc.scenarios_compile import GLOBAL_BATCH, STEPS, compiled_stages

RTOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    return run_world(compiled_stages, 2, str(tmp_path_factory.mktemp("compile")), timeout=400)[0]


def _assert_matches(run: dict[str, Any], reference: tuple[list[float], dict[str, Any]]) -> None:
    losses, weights = reference
    assert run["losses"] == pytest.approx(losses, rel=RTOL)
    for name, value in weights.items():
        assert rel_err(run["weights"][name], value) < RTOL, name


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_compiled_model_trains_like_the_uncompiled_reference(results: dict[Any, Any], stage: int) -> None:
    run = results[("run", stage)]
    assert run["is_compiled"]
    _assert_matches(run, reference_run(make_batches(STEPS, GLOBAL_BATCH), clip=0.5))


def test_engine_compile_at_stage_3_is_refused_with_the_fix(results: dict[Any, Any]) -> None:
    assert "initialize(model=torch.compile(model)" in results["stage3_engine_compile"]


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("save_compiled", [True, False], ids=["compiled-to-plain", "plain-to-compiled"])
def test_checkpoint_round_trip_between_compiled_and_plain(results: dict[Any, Any], stage: int,
                                                          save_compiled: bool) -> None:
    run = results[("resume", stage, save_compiled)]
    plain_names = {name for name, p in make_model().named_parameters() if p.requires_grad}
    assert set(run["names"]) == plain_names  # no '_orig_mod.' prefix
    _assert_matches(run, reference_run(make_batches(STEPS, GLOBAL_BATCH), clip=0.5))


def test_a_module_reading_a_child_weight_points_to_set_z3_leaf_modules(results: dict[Any, Any]) -> None:
    plain, as_leaf, compiled = (results["leaf_hint"][k] for k in (False, True, "compiled"))
    assert "set_z3_leaf_modules(model, [ThatModuleClass])" in compiled and "shape [0]" in compiled
    assert as_leaf == "trained" and plain == "trained"  # eager: the read gathers the weight (DeepSpeed's way)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_activation_checkpointing_trains_like_the_reference(results: dict[Any, Any], stage: int) -> None:
    _assert_matches(results["checkpointed"][stage], reference_run(make_batches(STEPS, GLOBAL_BATCH), clip=0.5))
