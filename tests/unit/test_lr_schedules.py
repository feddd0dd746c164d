"""DeepSpeed's lr schedules against hand-computed formula values; resume; build_scheduler."""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any, Iterator

import pytest
import torch

import deepshard.optim as optim
from deepshard.optim import (VALID_LR_SCHEDULES, LRRangeTest, OneCycle, WarmupCosineLR,
                             WarmupDecayLR, WarmupLR, build_scheduler)



@contextlib.contextmanager
def _logged() -> Iterator[list[logging.LogRecord]]:
    """The records deepshard's logger emits inside the block."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("deepshard")
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)


def _sgd(lr: float = 0.1, groups: int = 1, **kwargs: Any) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)]
    return torch.optim.SGD(params, lr=lr, **kwargs)


def _adam(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=lr, betas=(0.9, 0.999))


def _lrs_by_iteration(make: Callable[..., Any], last: int) -> dict[int, float]:
    """Construct (iteration -1), then step() to ``last``; the optimizer's lr at each iteration."""
    opt = _sgd()
    sched = make(opt)
    seen = {-1: opt.param_groups[0]["lr"]}
    assert sched.get_last_lr() == [seen[-1]]
    for t in range(last + 1):
        sched.step()
        assert sched.last_batch_iteration == t
        seen[t] = opt.param_groups[0]["lr"]
        assert sched.get_last_lr() == [seen[t]]
    return seen


def _check(seen: dict[int, float], expected: dict[int, float]) -> None:
    for t, value in expected.items():
        assert seen[t] == pytest.approx(value, rel=1e-12, abs=1e-15), f"iteration {t}"


# ----------------------------------------------------------------------------- WarmupLR

def test_warmup_lr_log() -> None:
    seen = _lrs_by_iteration(lambda o: WarmupLR(o, warmup_min_lr=0.01, warmup_max_lr=0.1,
                                                warmup_num_steps=10), 30)
    log = lambda t: 0.01 + 0.09 * math.log(t + 1) / math.log(10)  # noqa: E731
    _check(seen, {-1: 0.01, 0: 0.01, 1: log(1), 5: log(5), 9: 0.1, 10: 0.1, 30: 0.1})
    assert seen[1] == pytest.approx(0.01 + 0.09 * 0.30102999566)  # log(2) / log(10)


def test_warmup_lr_linear() -> None:
    seen = _lrs_by_iteration(lambda o: WarmupLR(o, warmup_min_lr=0.01, warmup_max_lr=0.1,
                                                warmup_num_steps=10, warmup_type="linear"), 12)
    _check(seen, {-1: 0.01, 0: 0.01, 1: 0.019, 5: 0.055, 9: 0.091, 10: 0.1, 12: 0.1})


def test_warmup_lr_default_max_is_each_groups_lr_and_one_step_means_two() -> None:
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
                           {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2}])
    sched = WarmupLR(opt, warmup_num_steps=1, warmup_type="linear")
    assert sched.max_lrs == [0.1, 0.2] and sched.warmup_num_steps == 2
    assert sched.get_last_lr() == [0.0, 0.0]
    sched.step(1)  # 1 / 2 of the way
    assert sched.get_last_lr() == pytest.approx([0.05, 0.1])
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.05, 0.1])


# ----------------------------------------------------------------------------- WarmupDecayLR

def test_warmup_decay_lr_linear_warmup_then_linear_decay() -> None:
    seen = _lrs_by_iteration(lambda o: WarmupDecayLR(o, total_num_steps=20, warmup_max_lr=0.1,
                                                     warmup_num_steps=10,
                                                     warmup_type="linear"), 25)
    _check(seen, {-1: 0.0, 0: 0.0, 1: 0.01, 5: 0.05, 9: 0.09, 10: 0.1, 11: 0.09, 15: 0.05,
                  19: 0.01, 20: 0.0, 25: 0.0})


def test_warmup_decay_lr_default_max_is_0_001_and_decays_to_min() -> None:
    seen = _lrs_by_iteration(lambda o: WarmupDecayLR(o, total_num_steps=8, warmup_min_lr=1e-4,
                                                     warmup_num_steps=4), 9)
    _check(seen, {-1: 1e-4, 2: 1e-4 + 9e-4 * math.log(3) / math.log(4), 4: 1e-3,
                  6: 1e-4 + 9e-4 * 0.5, 8: 1e-4, 9: 1e-4})


# ----------------------------------------------------------------------------- WarmupCosineLR

def test_warmup_cosine_lr() -> None:
    seen = _lrs_by_iteration(lambda o: WarmupCosineLR(o, total_num_steps=20, warmup_min_ratio=0.1,
                                                      warmup_num_steps=10, cos_min_ratio=0.01,
                                                      warmup_type="linear"), 30)
    cosine = lambda p: 0.1 * (0.01 + 0.99 * (1 + math.cos(math.pi * p)) / 2)  # noqa: E731
    _check(seen, {-1: 0.0, 0: 0.01, 5: 0.1 * 0.55, 9: 0.1 * (0.1 + 0.9 * 0.9),
                  10: cosine(0.1), 14: cosine(0.5), 19: 0.001, 20: 0.001, 30: 0.001})
    assert seen[14] == pytest.approx(0.1 * 0.505)


def test_warmup_cosine_lr_log_warmup() -> None:
    seen = _lrs_by_iteration(lambda o: WarmupCosineLR(o, total_num_steps=100,
                                                      warmup_num_steps=10), 3)
    _check(seen, {0: 0.0, 3: 0.1 * math.log(4) / math.log(10)})


# ----------------------------------------------------------------------------- OneCycle

def test_one_cycle_lr_phases_and_decay() -> None:
    seen = _lrs_by_iteration(lambda o: OneCycle(o, cycle_min_lr=0.01, cycle_max_lr=0.1,
                                                cycle_first_step_size=4,
                                                cycle_second_step_size=6, decay_lr_rate=0.5,
                                                decay_step_size=2), 13)
    _check(seen, {-1: 0.01, 0: 0.01 + 0.09 / 4, 2: 0.01 + 0.09 * 3 / 4, 3: 0.1,
                  4: 0.01 + 0.09 * 5 / 6, 8: 0.01 + 0.09 / 6, 9: 0.01,
                  10: 0.01 / 1.25, 13: 0.01 / 2.0})


def test_one_cycle_without_decay_holds_min_lr() -> None:
    seen = _lrs_by_iteration(lambda o: OneCycle(o, 0.01, 0.1, cycle_first_step_size=2), 8)
    _check(seen, {0: 0.055, 1: 0.1, 2: 0.055, 3: 0.01, 4: 0.01, 8: 0.01})


def test_one_cycle_stairs() -> None:
    seen = _lrs_by_iteration(lambda o: OneCycle(o, 0.0, 1.0, cycle_first_step_size=4,
                                                cycle_second_step_size=6,
                                                cycle_first_stair_count=2,
                                                cycle_second_stair_count=3), 9)
    # Rising half: floor(i * 2 / 4) / 2; falling half: floor((10 - i) * 3 / 6) / 3.
    _check(seen, {0: 0.0, 1: 0.5, 2: 0.5, 3: 1.0, 4: 2 / 3, 5: 2 / 3, 6: 1 / 3, 8: 0.0})


def test_one_cycle_cycles_adam_beta1_inversely_as_deepspeed() -> None:
    """DeepSpeed 0.19.8's OneCycle: the groups start at (cycle_min_mom, 0.99); each step writes
    (beta1, 0.99), beta2 overwritten; get_mom() answers those pairs (DeepSpeed's own test reads
    get_mom()[group][0])."""
    opt = _adam()
    sched = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=4, cycle_second_step_size=4,
                     cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.1,
                     decay_step_size=2)
    assert opt.param_groups[0]["betas"] == (0.8, 0.99) and sched.get_mom() == [(0.9, 0.99)]
    betas = {}
    for t in range(10):
        sched.step()
        betas[t] = opt.param_groups[0]["betas"]
        assert sched.get_mom() == [betas[t]]
    expected = {0: 0.875, 3: 0.8, 5: 0.85, 7: 0.9, 9: 0.9 * 1.1}
    for t, beta1 in expected.items():
        assert betas[t][0] == pytest.approx(beta1), t
        assert betas[t][1] == 0.99


def test_one_cycle_per_group_momentum_lists() -> None:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))]},
              {"params": [torch.nn.Parameter(torch.zeros(1))], "betas": (0.5, 0.95)}]
    opt = torch.optim.Adam(groups, lr=0.1)
    sched = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=4, cycle_min_mom=[0.8, 0.7], cycle_max_mom=[0.9, 0.85])
    assert [g["betas"] for g in opt.param_groups] == [(0.8, 0.99), (0.7, 0.99)]
    for _ in range(4):
        sched.step()  # to the peak lr: each group's minimum momentum
    assert [g["betas"] for g in opt.param_groups] == [(0.8, 0.99), (0.7, 0.99)]
    sched.step(-1)
    assert sched.get_mom() == [(0.9, 0.99), (0.85, 0.99)]
    with pytest.raises(ValueError, match="cycle_min_mom has 3 values but the optimizer has 2"):
        OneCycle(opt, 0.01, 0.1, cycle_min_mom=[0.8, 0.7, 0.6])


def test_one_cycle_with_no_second_half_only_rises() -> None:
    """cycle_second_step_size=0 (DeepSpeed accepts it): the lr rises over the first half, drops back to
    cycle_min_lr when the cycle ends, and stays there (no decay configured)."""
    opt = _adam()
    sched = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=4, cycle_second_step_size=0)
    lrs = []
    for _ in range(7):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step()
    assert lrs == pytest.approx([0.01, 0.0325, 0.055, 0.0775, 0.01, 0.01, 0.01])
    with pytest.raises(ValueError, match="cycle_second_step_size must be >= 0"):
        OneCycle(opt, 0.01, 0.1, cycle_second_step_size=-1)


def test_one_cycle_leaves_sgd_momentum_and_optimizers_without_betas_alone() -> None:
    """DeepSpeed cycles only Adam-style betas: SGD's momentum and Adagrad are left as they are."""
    for opt in (_sgd(momentum=0.5), torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(1))])):
        sched = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=2)
        sched.step(1)
        assert not sched.cycle_momentum and sched.get_mom() is None
        assert opt.param_groups[0].get("momentum", 0.5) == 0.5 and "betas" not in opt.param_groups[0]
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


@pytest.mark.parametrize("make", [
    lambda o, t: WarmupLR(o, warmup_num_steps=4, warmup_max_lr=0.001, warmup_type=t),
    lambda o, t: WarmupCosineLR(o, total_num_steps=10, warmup_num_steps=4, warmup_type=t),
])
def test_unknown_warmup_type_warms_up_with_log(make: Callable[..., Any]) -> None:
    """As DeepSpeed: an unknown warmup_type warns and warms up with 'log' (same values as 'log')."""
    with _logged() as records:
        unknown, log_opt = _adam(), _adam()
        a, b = make(unknown, "cosine"), make(log_opt, "log")
    assert a.warmup_type == "log" and any("unknown warmup_type 'cosine'" in r.getMessage() for r in records)
    for _ in range(6):
        assert unknown.param_groups[0]["lr"] == log_opt.param_groups[0]["lr"]
        a.step()
        b.step()


# ----------------------------------------------------------------------------- LRRangeTest

def test_lr_range_test_continuous_and_staircase() -> None:
    seen = _lrs_by_iteration(lambda o: LRRangeTest(o, lr_range_test_min_lr=0.01,
                                                   lr_range_test_step_size=10,
                                                   lr_range_test_step_rate=2.0), 9)
    _check(seen, {-1: 0.01, 0: 0.012, 4: 0.02, 9: 0.03})
    seen = _lrs_by_iteration(lambda o: LRRangeTest(o, 0.01, 10, 2.0, True), 25)
    _check(seen, {-1: 0.01, 0: 0.01, 8: 0.01, 9: 0.03, 18: 0.03, 19: 0.05, 25: 0.05})


# ----------------------------------------------------------------------------- common behaviour

_MAKERS = {
    "WarmupLR": lambda o, **kw: WarmupLR(o, 0.0, 0.1, 10, **kw),
    "WarmupDecayLR": lambda o, **kw: WarmupDecayLR(o, 30, 0.0, 0.1, 10, **kw),
    "WarmupCosineLR": lambda o, **kw: WarmupCosineLR(o, 30, 0.05, 10, **kw),
    "OneCycle": lambda o, **kw: OneCycle(o, 0.01, 0.1, decay_lr_rate=0.1,
                                         cycle_first_step_size=5, decay_step_size=3, **kw),
    "LRRangeTest": lambda o, **kw: LRRangeTest(o, 0.01, 5, 1.0, True, **kw),
}


@pytest.mark.parametrize("name", sorted(_MAKERS))
def test_state_dict_resume_gives_identical_lrs(name: str) -> None:
    opt, resumed_opt = _adam(), _adam()
    sched = _MAKERS[name](opt)
    for _ in range(12):
        sched.step()
    state = sched.state_dict()
    assert state == {"last_batch_iteration": 11}
    resumed = _MAKERS[name](resumed_opt)
    resumed.load_state_dict(state)
    assert resumed.get_last_lr() == sched.get_last_lr()
    assert resumed_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for _ in range(20):
        sched.step()
        resumed.step()
        assert resumed.get_last_lr() == sched.get_last_lr()
        assert resumed_opt.param_groups[0]["betas"] == opt.param_groups[0]["betas"]


@pytest.mark.parametrize("name", sorted(_MAKERS))
def test_explicit_iteration_matches_sequential_steps_and_constructor(name: str) -> None:
    sequential = _lrs_by_iteration(_MAKERS[name], 25)
    jump = _MAKERS[name](_sgd())
    for t in (25, 3, 17):
        jump.step(t)
        assert jump.get_last_lr() == [sequential[t]]
    opt = _sgd()
    started = _MAKERS[name](opt, last_batch_iteration=7)
    assert opt.param_groups[0]["lr"] == sequential[7]
    started.step()
    assert started.get_last_lr() == [sequential[8]]


def test_per_group_lists() -> None:
    opt = _sgd(groups=2)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.2],
                     warmup_num_steps=4, warmup_type="linear")
    sched.step(2)
    assert sched.get_last_lr() == pytest.approx([0.5, 0.15])
    sched = LRRangeTest(opt, lr_range_test_min_lr=[0.01, 0.02], lr_range_test_step_size=1)
    assert sched.get_last_lr() == pytest.approx([0.01, 0.02])


def test_tensor_lr_is_updated_in_place() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=torch.tensor(0.1))
    lr_tensor = opt.param_groups[0]["lr"]
    sched = WarmupLR(opt, warmup_num_steps=4, warmup_type="linear")
    sched.step(2)
    assert opt.param_groups[0]["lr"] is lr_tensor and float(lr_tensor) == pytest.approx(0.05)


@pytest.mark.parametrize("make, fragment", [
    (lambda o: WarmupLR(o, warmup_num_steps=0), "warmup_num_steps must be an integer >= 1"),
    (lambda o: WarmupCosineLR(o, total_num_steps=0), "total_num_steps must be an integer >= 1"),
    (lambda o: OneCycle(o, 0.1, 1.0, cycle_first_step_size=0), "cycle_first_step_size"),
    (lambda o: OneCycle(o, 0.1, 1.0, decay_step_size=-1), "decay_step_size"),
    (lambda o: LRRangeTest(o, lr_range_test_step_size=0), "lr_range_test_step_size"),
    (lambda o: WarmupLR(o, warmup_min_lr=[0.0, 0.1]), "2 values but the optimizer has 1"),
])
def test_invalid_arguments_raise(make: Callable[..., Any], fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        make(_sgd())
    assert fragment in str(info.value)


def test_total_steps_inside_warmup_warns() -> None:
    with _logged() as records:
        WarmupDecayLR(_sgd(), total_num_steps=5, warmup_num_steps=10)
    assert any("total_num_steps (5) is less than warmup_num_steps (10)" in r.getMessage()
               for r in records)


# ----------------------------------------------------------------------------- build_scheduler

def test_build_scheduler_deepspeed_names() -> None:
    for name in VALID_LR_SCHEDULES:
        params = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1} if name == "OneCycle" else {}
        if name in ("WarmupDecayLR", "WarmupCosineLR"):
            params = {"total_num_steps": 100, "warmup_num_steps": 10}
        sched = build_scheduler(name, params, _sgd())
        assert type(sched).__name__ == name
    sched = build_scheduler("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.2,
                                         "warmup_num_steps": 4, "warmup_type": "linear"}, _sgd())
    sched.step(2)
    assert sched.get_last_lr() == [0.1]


def test_build_scheduler_torch_fallback() -> None:
    opt = _sgd(lr=0.1)
    sched = build_scheduler("StepLR", {"step_size": 2, "gamma": 0.5}, opt)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    for _ in range(4):
        opt.step()
        sched.step()
    assert sched.get_last_lr() == pytest.approx([0.025])
    assert isinstance(sched, optim.LRSchedulerLike)
    assert isinstance(build_scheduler("WarmupLR", None, _sgd()), optim.LRSchedulerLike)


@pytest.mark.parametrize("type_name, params, fragments", [
    ("warmuplr", {}, ["'warmuplr' (did you mean 'WarmupLR'?)", "WarmupCosineLR"]),
    ("WarmupLRR", {}, ["did you mean 'WarmupLR'", "VALID_LR_SCHEDULES", "StepLR"]),
    ("steplr", {}, ["did you mean 'StepLR'"]),
    ("Nope", {}, ["unknown scheduler type 'Nope'", "LRRangeTest, OneCycle"]),
    ("WarmupLR", {"warmup_steps": 5}, ["'warmup_steps'", "did you mean 'warmup_num_steps'",
                                       "accepted: warmup_min_lr"]),
    ("WarmupDecayLR", {}, ["requires scheduler.params 'total_num_steps'"]),
    ("OneCycle", {"cycle_min_lr": 0.1}, ["'cycle_max_lr'"]),
    ("StepLR", {}, ["requires scheduler.params 'step_size'"]),
    ("StepLR", {"step_size": 2, "gama": 0.5}, ["'gama'", "'gamma'"]),
    ("WarmupLR", {"warmup_max_lr": "auto"}, ["scheduler.params.warmup_max_lr", "auto"]),
])
def test_build_scheduler_errors(type_name: str, params: dict[str, Any],
                                fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        build_scheduler(type_name, params, _sgd())
    for fragment in fragments:
        assert fragment in str(info.value)


def test_runtime_module_matches_deepspeed_paths() -> None:
    from deepshard.runtime import lr_schedules

    assert lr_schedules.WarmupLR is WarmupLR and lr_schedules.OneCycle is OneCycle
    assert lr_schedules.VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR",
                                               "WarmupDecayLR", "WarmupCosineLR"]
    parser = lr_schedules.add_tuning_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--lr_schedule", "WarmupLR", "--warmup_num_steps", "7"])
    assert (args.lr_schedule, args.warmup_num_steps, args.warmup_max_lr) == ("WarmupLR", 7, 0.001)
    assert args.cycle_momentum is False


@pytest.mark.parametrize("extra, ratio, skip_lr, skip_mom", [
    ({"cycle_second_step_size": 0}, 1.0, True, True),
    ({"decay_step_size": 5}, 0.5, True, True),
    ({"decay_step_size": 5, "decay_lr_rate": 0.1}, 0.5, False, True),
    ({"decay_step_size": 5, "decay_mom_rate": 0.1}, 0.5, True, False),
])
def test_schedules_expose_deepspeeds_public_attributes(extra: dict[str, Any], ratio: float, skip_lr: bool,
                                                      skip_mom: bool) -> None:
    """The attributes DeepSpeed's own scheduler tests and scripts read (values taken from DeepSpeed 0.19.8)."""
    param = torch.nn.Parameter(torch.zeros(1))
    cycle = OneCycle(torch.optim.Adam([param], lr=0.1), cycle_min_lr=0.001, cycle_max_lr=0.1,
                     cycle_first_step_size=10, **extra)
    assert (cycle.step_ratio, cycle.skip_lr_decay, cycle.skip_mom_decay) == (ratio, skip_lr, skip_mom)
    warm = WarmupLR(torch.optim.Adam([param], lr=0.1), warmup_num_steps=10)
    cosine = WarmupCosineLR(torch.optim.Adam([param], lr=0.1), total_num_steps=100, warmup_num_steps=10)
    assert warm.inverse_log_warm_up == cosine.inverse_log_warm_up == pytest.approx(0.43429448190325176)
    assert cosine.org_lrs == [0.1]
    stairs = LRRangeTest(torch.optim.Adam([param], lr=0.1), lr_range_test_step_size=4, lr_range_test_staircase=True)
    for _ in range(4):
        stairs.step()
    assert stairs.interval_fn() == 1.0
