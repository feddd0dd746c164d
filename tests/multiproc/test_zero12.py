"""ZeRO stages 1 and 2: memory and traffic against the ZeRO formulas; for stages 1-3 the safe_get/set_*
helpers and checkpoints saved on 2 processes resumed on 1, 2, 3 and 4 processes under any stage 0-3."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.zero.grad_norm import LIMBS
from tests.multiproc.harness import run_world
from tests.multiproc.models import make_batches, make_model, micro_slice, reference_run, rel_err
from tests.multiproc.scenarios_zero12 import (GLOBAL_BATCH, accounting, resume_world, safe_getters, save_world,
                                              written)

WORLD = 2


@pytest.fixture(scope="module")
def acct() -> dict[Any, Any]:
    return run_world(accounting, WORLD)[0]


# model-state bytes per process (PRODUCT.md), Psi trainable parameters, N processes
FORMULAS = {
    (1, "fp32"): lambda psi, n: 8 * psi + 8 * psi / n,
    (2, "fp32"): lambda psi, n: 4 * psi + 12 * psi / n,
    (1, "bf16"): lambda psi, n: 4 * psi + 12 * psi / n,
    (2, "bf16"): lambda psi, n: 2 * psi + 14 * psi / n,
}


@pytest.mark.parametrize("key", list(FORMULAS), ids=lambda k: f"stage{k[0]}-{k[1]}")
def test_model_state_bytes_match_zero_formula(acct: dict[Any, Any], key: tuple[int, str]) -> None:
    r = acct[key]
    report, psi = r["report"], r["psi"]
    elsize = 4 if key[1] == "fp32" else 2
    trainable_param_bytes = report["parameters"] - elsize * r["frozen"]
    model_states = trainable_param_bytes + report["gradients"] + report["master_weights"] + report["optimizer_state"]
    expected = FORMULAS[key](psi, WORLD)
    assert abs(model_states - expected) <= 0.05 * expected, (model_states, expected, report)


@pytest.mark.parametrize("stage", [1, 2])
def test_comms_volume_is_two_psi_per_step(acct: dict[Any, Any], stage: int) -> None:
    r = acct[(stage, "fp32")]
    psi = r["psi"]
    moved = r["comms"]["reduce_scatter"]["volume_elements"] + r["comms"]["all_gather"]["volume_elements"]
    assert abs(moved - 2 * psi) <= 0.02 * 2 * psi, (moved, 2 * psi, r["comms"])
    assert "all_reduce" not in r["comms"]  # no full-gradient all-reduce: only the grad norm's small ones
    assert r["comms"]["all_reduce(scalar)"]["elements"] == LIMBS  # the exact sum of squares (int64 limbs)
    assert r["comms"]["all_reduce(max)"]["elements"] == 1  # the largest element, which sets its scale


def _reference_state_after(steps: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    batches = make_batches(steps + 1, 2 * WORLD, seed=seed)
    for x, y in batches[:steps]:
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    xs = [micro_slice(batches[steps], 2, 0, r, WORLD) for r in range(WORLD)]
    x = torch.cat([a.cpu() for a, _ in xs])  # micro_slice gives the ranks' device; the reference is on the CPU
    y = torch.cat([b.cpu() for _, b in xs])
    model(x, y).backward()
    return model, opt


@pytest.fixture(scope="module", params=[1, 2, 3])
def getters(request: Any) -> tuple[int, list[dict[str, Any]]]:
    return request.param, run_world(safe_getters, WORLD, request.param)


def test_safe_get_full_helpers_match_reference(getters: tuple[int, list[dict[str, Any]]]) -> None:
    stage, outs = getters
    model, opt = _reference_state_after(2, seed=21)
    for out in outs:  # every rank gets the full tensors
        for name, p in model.named_parameters():
            if not p.requires_grad:  # DeepSpeed's answer: the optimizer holds no fp32 copy of a frozen parameter
                assert out["fp32"][name] is None, name
                continue
            assert rel_err(out["fp32"][name], p.detach()) < 1e-5, name
            assert rel_err(out["grad"][name], p.grad) < 1e-5, name
            assert rel_err(out["exp_avg"][name], opt.state[p]["exp_avg"]) < 1e-5, name
    for name, value in outs[0]["fp32"].items():
        assert value is None and outs[1]["fp32"][name] is None or torch.equal(value, outs[1]["fp32"][name]), name


def _reference_after_writes(stage: int) -> dict[str, dict[str, torch.Tensor]]:
    """``safe_writers`` on single-process PyTorch: the written values and gradients, a clipped AdamW step, the
    written optimizer states (at stage 3 the value and exp_avg doubled, as each rank doubles its part), one
    more step on the next batch."""
    model, opt = _reference_state_after(2, seed=21)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    values, grads = written(params, 1), written(params, 2)
    states = {"exp_avg": written(params, 3), "exp_avg_sq": written(params, 4)}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(values[n])
            p.grad = grads[n].clone()
        x, y = make_batches(1, 2 * WORLD, seed=22)[0]
        out_full = [float(model(x[2 * r:2 * r + 2], y[2 * r:2 * r + 2])) for r in range(WORLD)]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    out = {"stepped": {n: p.detach().clone() for n, p in params.items()}, "full_loss": out_full}
    with torch.no_grad():
        for n, p in params.items():
            for key, by_name in states.items():
                opt.state[p][key] = by_name[n].clone() * (2 if stage == 3 and key == "exp_avg" else 1)
            p.mul_(2 if stage == 3 else 1)
    opt.zero_grad()
    x, y = make_batches(1, 2 * WORLD, seed=22)[0]
    model(x, y).backward()
    out["final_grad"] = {n: p.grad.detach().clone() for n, p in params.items()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    out["final"] = {n: p.detach().clone() for n, p in params.items()}
    return out


def test_safe_set_helpers_write_every_rank_s_part(getters: tuple[int, list[dict[str, Any]]]) -> None:
    """The writers against torch: what is written reads back exactly on every rank, and the steps taken from
    it are the reference's; at stage 3 the local parts, in rank order, are the full values and ds_tensor."""
    stage, outs = getters
    ref = _reference_after_writes(stage)
    names = dict(make_model().named_parameters())
    values, grads = written(names, 1), written(names, 2)
    states = {"exp_avg": written(names, 3), "exp_avg_sq": written(names, 4)}
    for rank, out in enumerate(o["writes"] for o in outs):
        assert set(out["fp32"]) == set(values) and len(values) > 0
        assert out["loss_after_full_write"] == pytest.approx(ref["full_loss"][rank], rel=1e-5)
        for name in values:
            assert torch.equal(out["fp32"][name], values[name]) and torch.equal(out["grad"][name], grads[name]), name
            assert rel_err(out["stepped"][name], ref["stepped"][name]) < 1e-5, name
            for key, by_name in states.items():
                assert torch.equal(out["states"][key][name], by_name[name]), (key, name)
            assert rel_err(out["final"][name], ref["final"][name]) < 1e-5, name
            # engine.scale(loss).backward() then allreduce_gradients(): reduced there, once; at stage 3 that forward
            # computes with the values the local writes doubled, in the groups kept gathered (persistent) too
            assert rel_err(out["scaled_grad"][name], ref["final_grad"][name]) < 1e-5, name
            assert torch.equal(out["scaled_grad_again"][name], out["scaled_grad"][name]), name
    if stage != 3:
        return
    assert all(o["writes"]["persistent"] for o in outs)  # the forward after the local writes used kept groups
    for name, full in outs[0]["writes"]["stepped"].items():
        local = [o["writes"]["local"][name] for o in outs]
        after = [o["writes"]["local_after"][name] for o in outs]
        assert torch.equal(torch.cat([value for value, _ in local]), full.reshape(-1)), name
        assert all(torch.equal(value, ds_tensor) for value, ds_tensor in local), name
        assert all(torch.equal(a[0], 2 * value) and torch.equal(a[1], 2 * value) for a, (value, _) in zip(after, local))
        assert torch.equal(torch.cat([a[2] for a in after]), 2 * states["exp_avg"][name].reshape(-1)), name


@pytest.fixture(scope="module")
def saved(tmp_path_factory: Any) -> dict[Any, Any]:
    out = {}
    for stage in (0, 2, 3):
        tmp = tmp_path_factory.mktemp(f"save_stage{stage}")
        losses = run_world(save_world, WORLD, stage, "fp32", str(tmp))[0]
        out[stage] = (tmp, losses)
    return out


@pytest.mark.parametrize("saved_stage,world,stage", [(2, 1, 0), (2, 3, 1), (2, 4, 2), (0, 4, 2), (0, 3, 2),
                                                      (2, 2, 2), (3, 1, 0), (3, 3, 3), (2, 4, 3), (0, 2, 3)])
def test_resume_on_another_process_count_and_stage(saved: dict[Any, Any], saved_stage: int, world: int,
                                                   stage: int) -> None:
    tmp, first_losses = saved[saved_stage]
    out = run_world(resume_world, world, stage, "fp32", str(tmp))[0]
    ref_losses, ref_w = reference_run(make_batches(6, GLOBAL_BATCH, seed=31), clip=0.5)
    assert first_losses == pytest.approx(ref_losses[:3], rel=1e-6)
    assert out["losses"] == pytest.approx(ref_losses[3:], rel=1e-6)
    for name, value in ref_w.items():
        assert rel_err(out["weights"][name], value) <= 1e-6, name
    assert out["client"] == {"saved_by": WORLD} and out["steps"] == 6
