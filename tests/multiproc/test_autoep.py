"""AutoEP (the ``expert_parallel`` config section): tiny transformers Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE
models built from a config (no download), and a model whose MoE blocks read their fused experts themselves
(``inline``: AutoEP routes for it), their experts split over 2 or 4 expert-parallel ranks without a
change to the model's code, must train with the dense run's losses and weights (one process, every expert,
the whole batch) at ZeRO 0-3; their checkpoints and 16-bit weights hold the whole fused expert tensors, so a
run without AutoEP resumes them and the other way round. (DeepSpeed 0.19.8's own AutoEP fails at initialize
with these transformers versions: REFERENCE_MOE 8.5.)"""
from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

from tests.multiproc.harness import run_world  # noqa: E402
from tests.multiproc.models import rel_err  # noqa: E402
from tests.multiproc.moe_models import reference_hf, token_batches  # noqa: E402
from tests.multiproc.scenarios_moe import autoep_cases, autoep_resume, autoep_save  # noqa: E402

WORLD2 = [("mixtral", 2, 2, "fp32"), ("qwen2_moe", 0, 2, "fp32"), ("qwen3_moe", 3, 2, "fp32"), ("olmoe", 1, 2, "fp32"),
          ("mixtral", 3, 2, "bf16"), ("inline", 2, 2, "fp32"), ("inline", 3, 2, "fp32")]
WORLD4 = [("mixtral", 2, 4, "fp32"), ("qwen3_moe", 3, 2, "fp32")]
LOSS = {"fp32": 1e-5, "bf16": 5e-3}      # measured: 1e-6 (fp32), 6e-4 (bf16 against the fp32 dense run)
WEIGHTS = {"fp32": 1e-3, "bf16": 0.3}    # measured: 4e-5 (a near-zero Adam update's round-off), bf16 0.16


@pytest.fixture(scope="module")
def world2() -> list[dict[Any, Any]]:
    return run_world(autoep_cases, 2, WORLD2, timeout=900)


@pytest.fixture(scope="module")
def world4() -> list[dict[Any, Any]]:
    return run_world(autoep_cases, 4, WORLD4, timeout=900)


def _check(results: list[dict[Any, Any]], case: tuple[str, int, int, str], world: int) -> None:
    kind, _, ep, dtype = case
    ref_losses, ref_weights = reference_hf(kind, token_batches(3, 4))
    r = results[0][case]
    assert r["local_experts"] == 4 // ep  # each rank holds its share of the fused experts
    # every MoE block is found as DeepSpeed's AutoEPMoELayer, its experts split over ep ranks
    assert [layer[0] for layer in r["layers"]] == ["model.layers.0.mlp", "model.layers.1.mlp"], r["layers"]
    assert all(layer[1:4] == (ep, 4 // ep, 4) for layer in r["layers"]), r["layers"]
    # ZeRO-3's placement record: experts partitioned over their expert-data-parallel group (world / ep ranks,
    # DeepSpeed's layout: consecutive ranks share an expert-parallel group), the rest over every rank
    placement = {rank: results[rank][case]["placement"] for rank in range(world)}
    assert bool(placement[0]) == (case[1] == 3), placement[0]
    for rank, record in placement.items():
        for name, got in record.items():
            expert = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
            want = (("autoep_expert", f"ep_size_{ep}", world // ep, rank // ep) if expert
                    else ("replicated", None, world, rank))
            assert got == want, (rank, name, got, want)
    assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) <= LOSS[dtype], (r["losses"], ref_losses)
    for rank in range(world):
        for name, (offset, value) in results[rank][case]["weights"].items():
            ref = ref_weights[name].reshape(-1)[offset:offset + value.numel()].view(value.shape)
            assert rel_err(value, ref) <= WEIGHTS[dtype], (rank, name, rel_err(value, ref))


@pytest.mark.parametrize("case", WORLD2, ids=lambda c: "-".join(map(str, c)))
def test_autoep_trains_as_the_dense_model_world2(world2: list[dict[Any, Any]], case: tuple) -> None:
    _check(world2, case, 2)


@pytest.mark.parametrize("case", WORLD4, ids=lambda c: "-".join(map(str, c)))
def test_autoep_trains_as_the_dense_model_world4(world4: list[dict[Any, Any]], case: tuple) -> None:
    _check(world4, case, 4)


def test_autoep_checkpoints_resume_with_and_without_autoep(tmp_path: Any) -> None:
    from safetensors.torch import load_file

    ref_losses, _ = reference_hf("mixtral", token_batches(3, 4))
    _, ref_after_two = reference_hf("mixtral", token_batches(3, 4)[:2])
    first = run_world(autoep_save, 2, "mixtral", 2, 2, str(tmp_path / "ep2"), timeout=600)[0]
    assert max(abs(a - b) for a, b in zip(first, ref_losses[:2])) <= LOSS["fp32"]
    weights = load_file(str(tmp_path / "ep2" / "weights" / "model.safetensors"))
    assert set(weights) == set(ref_after_two)  # the model's own names, the fused [E, ...] tensors whole
    for name, value in weights.items():
        assert rel_err(value, ref_after_two[name]) <= WEIGHTS["fp32"], name
    for world, stage, ep in ((1, 0, 1), (4, 3, 4)):  # dense on one process; AutoEP over 4 ranks at ZeRO-3
        resumed = run_world(autoep_resume, world, "mixtral", stage, ep, str(tmp_path / "ep2"), timeout=600)[0]
        assert abs(resumed[0] - ref_losses[2]) <= LOSS["fp32"], (world, resumed, ref_losses)
    run_world(autoep_save, 1, "mixtral", 1, 1, str(tmp_path / "dense"), timeout=600)  # without AutoEP ...
    resumed = run_world(autoep_resume, 2, "mixtral", 2, 2, str(tmp_path / "dense"), timeout=600)[0]  # ... into it
    assert abs(resumed[0] - ref_losses[2]) <= LOSS["fp32"], resumed
