"""The engine's contract beyond the oracle: accounting, no_sync, boundary override, the public API,
checkpoint damage, several engines per process, gradient pre-division and communication dtype. One
2-process world runs every scenario (``engine_contract``); the tests read its results."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.multiproc.device import device_kind
from tests.multiproc.harness import run_world
from tests.multiproc.models import make_batches, make_model, rel_err
from tests.multiproc.scenarios_engine import engine_contract

WORLD = 2


def _padded(psi: int, dp: int = WORLD) -> int:
    """Gradient buffers are padded to a multiple of the data-parallel size (stage 0 reduces them as a
    reduce-scatter plus an all-gather over the canonical tree): at most ``dp - 1`` extra elements."""
    return -(-psi // dp) * dp


@pytest.fixture(scope="module")
def contract(tmp_path_factory: Any) -> dict[str, Any]:
    return run_world(engine_contract, WORLD, str(tmp_path_factory.mktemp("api")))[0]


@pytest.fixture(scope="module")
def acct(contract: dict[str, Any]) -> dict[str, Any]:
    return contract["accounting"]


def test_memory_report_fp32_adam_is_16_psi(acct: dict[str, Any]) -> None:
    r = acct["fp32"]
    psi, total, report = r["psi_trainable"], r["psi_total"], r["report"]
    assert report["parameters"] == 4 * total  # frozen parameters are held too
    padded = _padded(psi)
    assert padded - psi < WORLD
    assert report["gradients"] == 4 * padded  # gradient buffers: trainable parameters only, padded to dp
    assert report["master_weights"] == 0
    assert report["optimizer_state"] == 8 * psi  # Adam: exp_avg + exp_avg_sq, fp32
    assert report["buffers"] == r["buffer_bytes"]
    model_states = report["gradients"] + report["optimizer_state"] + 4 * psi
    assert model_states == 16 * psi + 4 * (padded - psi)  # PRODUCT.md: DDP, fp32 Adam (+ the padding)
    assert report["total"] == sum(v for k, v in report.items() if k != "total")


def test_memory_report_bf16_adam_is_16_psi(acct: dict[str, Any]) -> None:
    r = acct["bf16"]
    psi, report = r["psi_trainable"], r["report"]
    padded = _padded(psi)
    assert report["gradients"] == 2 * padded
    assert report["master_weights"] == 4 * psi
    assert report["optimizer_state"] == 8 * psi
    model_states = report["gradients"] + report["master_weights"] + report["optimizer_state"] + 2 * psi
    assert model_states == 16 * psi + 2 * (padded - psi)


def test_comms_volume_is_two_psi_per_step(acct: dict[str, Any]) -> None:
    for dtype, elsize in (("fp32", 4), ("bf16", 2)):
        r = acct[dtype]
        padded = _padded(r["psi_trainable"])
        # the all-reduce is a reduce-scatter plus an all-gather of the padded buffer: once per step
        # despite 2 micro-steps, 1x each, 2x together, as the all-reduce was
        assert set(r["comms"]) == {"reduce_scatter", "all_gather"}
        for op in ("reduce_scatter", "all_gather"):
            assert r["comms"][op]["calls"] == 1
            assert r["comms"][op]["elements"] == r["comms"][op]["volume_elements"] == padded
            assert r["comms"][op]["bytes"] == r["comms"][op]["volume_bytes"] == padded * elsize
        assert r["volume"] == 2 * padded


def test_frozen_parameters_get_no_grad_and_no_optimizer_state(acct: dict[str, Any]) -> None:
    for dtype in ("fp32", "bf16"):
        assert acct[dtype]["frozen_in_state"] is False
        assert acct[dtype]["frozen_grad"] == [None, None]


def _sum_loss_reference(batches: list, world: int) -> dict[str, torch.Tensor]:
    """Single process: loss = mean over the first half of the batch + mean over the second half."""
    model = make_model()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    half = 2 * world
    for x, y in batches:
        (model(x[:half], y[:half]) + model(x[half:], y[half:])).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_no_sync_accumulates_locally_then_reduces_once(contract: dict[str, Any]) -> None:
    out = contract["no_sync"]
    ref = _sum_loss_reference(make_batches(2, 4 * WORLD, seed=9), WORLD)
    for name, value in ref.items():
        assert rel_err(out["no_sync"][name], value) <= 1e-6, name
        assert rel_err(out["boundary"][name], value) <= 1e-6, name
    assert out["calls_inside_first_no_sync"] == [0, 0]
    assert "no_sync" in out["step_in_no_sync"]
    assert out["applied"] == [False, True, False, True]


def test_coalesce_grad_reduction_reduces_once_with_the_plain_update(contract: dict[str, Any]) -> None:
    out = contract["coalesce"]
    ref = _sum_loss_reference(make_batches(2, 4 * WORLD, seed=9), WORLD)
    for stage in (1, 2, 3):
        plain, coalesced = out[(stage, "plain")], out[(stage, "coalesced")]
        for name, value in ref.items():  # the single-process run of both backward passes
            assert rel_err(plain["weights"][name], value) <= 1e-6, (stage, name)
            assert rel_err(coalesced["weights"][name], value) <= 1e-6, (stage, name)
            if stage == 1:  # the plain window holds its first backward locally too: the same sums, bit for bit
                assert torch.equal(plain["weights"][name], coalesced["weights"][name]), name
        assert [inside for inside, _ in coalesced["counts"]] == [0, 0], stage  # nothing reduced in the block
        at_exit, window = [n for _, n in coalesced["counts"]], [n for _, n in plain["counts"]]
        assert all(n > 0 for n in at_exit), (stage, at_exit)
        if stage == 1:
            assert at_exit == window
        else:  # stages 2 and 3 reduce every backward without the block: twice the reductions
            assert all(2 * c == p for c, p in zip(at_exit, window)), (stage, at_exit, window)
        step, no_sync, nested = out[(stage, "refusals")]
        for refusal, words in ((step, "engine.step()"), (no_sync, "no_sync() cannot be used"), (nested, "nested")):
            assert refusal.startswith("GradContextMisuse: ") and words in refusal, refusal


@pytest.fixture(scope="module")
def api(contract: dict[str, Any]) -> dict[str, Any]:
    return contract["api"]


def test_user_optimizer_and_callable_win_over_config(api: dict[str, Any]) -> None:
    from tests.multiproc.models import reference_run

    assert api["user_opt_is_used"] and api["loader_sched_none"]
    assert api["callable_opt_type"] == "SGD"
    ref_losses, ref_w = reference_run(make_batches(3, 2 * WORLD, seed=3), clip=0.0, sgd=True)
    for name, value in ref_w.items():
        assert rel_err(api["user_opt_weights"][name], value) <= 1e-6
        assert rel_err(api["callable_opt_weights"][name], value) <= 1e-6


def test_accessors_and_attribute_fallthrough(api: dict[str, Any]) -> None:
    assert api["getattr"] is True
    device = "cpu" if device_kind() == "cpu" else "cuda:0"  # rank 0's device
    assert api["accessors"] == (2 * WORLD, 2, 1, 0, WORLD, True, 3, 3 * 2 * WORLD, 3, device)


def test_dataloader_splits_samples_across_ranks(api: dict[str, Any]) -> None:
    assert api["loader_disjoint_cover"] is True


def test_load_from_empty_dir_returns_none(api: dict[str, Any]) -> None:
    assert api["empty_load"] == (None, None)


def test_save_16bit_and_load_module_only(api: dict[str, Any]) -> None:
    assert api["16bit_exact"] is True and api["16bit_dtype"] == "torch.bfloat16"
    weights_equal, steps = api["module_only"]
    assert weights_equal is True and steps == 0


def test_damaged_checkpoints_give_clear_errors(api: dict[str, Any]) -> None:
    assert "zero_rank0.safetensors" in api["corrupt"]
    assert "module_extra.safetensors" in api["truncated"]


def test_two_engines_in_one_process_do_not_interfere(contract: dict[str, Any]) -> None:
    out = contract["two_engines"]
    assert out == {"a": True, "b": True}


def test_predivide_prescale_and_comm_dtype_match_reference(contract: dict[str, Any]) -> None:
    from tests.multiproc.models import reference_run

    out = contract["predivide"]
    ref_losses, ref_w = reference_run(make_batches(4, 4 * WORLD, seed=11), clip=0.0, sgd=True)
    for name, tol in (("predivide", 1e-6), ("prescale", 1e-6), ("comm_fp16", 2e-3)):
        losses, weights = out[name]
        assert losses == pytest.approx(ref_losses, rel=tol)
        for key, value in ref_w.items():
            assert rel_err(weights[key], value) <= tol, (name, key)
