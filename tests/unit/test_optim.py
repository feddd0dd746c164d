"""Optimizers built from DeepSpeed config names, and the Lamb / Lion updates against hand math."""
from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

from deepshard.optim import Lamb, Lion, build_optimizer
from deepshard.optim.fused_adam import FusedAdam, FusedAdamW


def _param(values: list[float], grad: list[float]) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.tensor(values, dtype=torch.float64))
    p.grad = torch.tensor(grad, dtype=torch.float64)
    return p


# ----------------------------------------------------------------------------- name resolution

@pytest.mark.parametrize("type_name, params, cls, expected", [
    ("Adam", {"lr": 0.01}, FusedAdamW, {"lr": 0.01, "weight_decay": 0.0}),
    ("adam", {"adam_w_mode": False}, FusedAdam, {"weight_decay": 0.0, "decoupled_weight_decay": False}),
    ("adam", {"adam_w_mode": False, "torch_adam": True}, torch.optim.Adam,
     {"weight_decay": 0.0}),
    ("Adam", {"torch_adam": True}, torch.optim.AdamW, {"weight_decay": 0.0}),
    ("AdamW", {"adam_w_mode": False}, FusedAdamW, {"weight_decay": 0.0}),
    ("ADAMW", {"weight_decay": 0.1, "bias_correction": True}, FusedAdamW,
     {"weight_decay": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9}, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    ("sgd", {"lr": 0.2}, torch.optim.SGD, {"lr": 0.2}),
    ("Adagrad", {"lr": 0.05}, torch.optim.Adagrad, {"lr": 0.05, "eps": 1e-10}),
    ("Lamb", {}, Lamb, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                        "max_coeff": 10.0, "min_coeff": 0.01, "bias_correction": True}),
    ("lamb", {"lr": 0.02, "max_coeff": 5.0}, Lamb, {"lr": 0.02, "max_coeff": 5.0}),
    ("Lion", {}, Lion, {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}),
    ("LION", {"lr": 3e-4, "set_grad_none": True}, Lion, {"lr": 3e-4}),
    ("RMSprop", {"lr": 0.01}, torch.optim.RMSprop, {"lr": 0.01}),
    ("rmsprop", {"alpha": 0.9}, torch.optim.RMSprop, {"alpha": 0.9}),
    ("NAdam", {}, torch.optim.NAdam, {"lr": 2e-3}),
])
def test_name_resolves_to_class_and_hyperparameters(type_name: str, params: dict[str, Any],
                                                    cls: type, expected: dict[str, Any]) -> None:
    model = torch.nn.Linear(3, 2)
    original = copy.deepcopy(params)
    opt = build_optimizer(type_name, params, model.parameters())
    assert type(opt) is cls
    for key, value in expected.items():
        assert opt.param_groups[0][key] == value, key
    assert params == original  # the config dict is not modified


def test_config_adam_is_deepspeeds_fused_adam_and_torchs_adamw() -> None:
    # DeepSpeed's tests check isinstance(optimizer, FusedAdam); code written for torch checks AdamW
    opt = build_optimizer("Adam", {"lr": 0.01}, torch.nn.Linear(3, 2).parameters())
    assert isinstance(opt, FusedAdam) and isinstance(opt, torch.optim.AdamW) and opt.adam_w_mode
    from deepshard.ops.adam import FusedAdam as OpsFusedAdam

    assert OpsFusedAdam is FusedAdam
    l2 = build_optimizer("Adam", {"adam_w_mode": False}, torch.nn.Linear(3, 2).parameters())
    assert isinstance(l2, FusedAdam) and not isinstance(l2, torch.optim.AdamW) and not l2.adam_w_mode


def test_betas_list_becomes_tuple_and_param_groups_pass_through() -> None:
    model = torch.nn.Linear(3, 2)
    groups = [{"params": [model.weight], "weight_decay": 0.1},
              {"params": [model.bias], "weight_decay": 0.0}]
    opt = build_optimizer("Adam", {"lr": 1e-3, "betas": [0.8, 0.95]}, groups)
    assert opt.param_groups[0]["betas"] == (0.8, 0.95)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    lamb = build_optimizer("Lamb", {"betas": [0.5, 0.6]}, model.parameters())
    assert lamb.param_groups[0]["betas"] == (0.5, 0.6)


def test_adam_w_mode_decoupled_vs_l2_one_step() -> None:
    lr, wd, eps = 0.1, 1.0, 1e-8
    values, grad = [1.0, -2.0], [0.05, 0.5]
    p_w, p_l2 = _param(values, grad), _param(values, grad)
    base = {"lr": lr, "weight_decay": wd, "eps": eps}
    build_optimizer("Adam", base, [p_w]).step()  # adam_w_mode defaults to True
    build_optimizer("Adam", {**base, "adam_w_mode": False}, [p_l2]).step()
    # First Adam step: m_hat = g, v_hat = g^2, so the step is lr * g / (|g| + eps).
    decoupled = [w * (1 - lr * wd) - lr * g / (abs(g) + eps) for w, g in zip(values, grad)]
    l2_grad = [g + wd * w for w, g in zip(values, grad)]
    coupled = [w - lr * g / (abs(g) + eps) for w, g in zip(values, l2_grad)]
    assert p_w.tolist() == pytest.approx(decoupled, abs=1e-12)
    assert p_l2.tolist() == pytest.approx(coupled, abs=1e-12)
    assert p_w.tolist() == pytest.approx([0.8, -1.9])
    assert p_l2.tolist() == pytest.approx([0.9, -1.9])


# ----------------------------------------------------------------------------- Lamb

def _lamb_reference(w: list[float], g: list[float], m: list[float], v: list[float], step: int,
                    lr: float, b1: float, b2: float, eps: float, wd: float, lo: float,
                    hi: float) -> tuple[list[float], list[float], list[float], float]:
    """LAMB on python lists: returns (new w, m, v, trust ratio)."""
    m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
    v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g)]
    c1, c2 = 1 - b1 ** step, 1 - b2 ** step
    u = [(mi / c1) / (math.sqrt(vi / c2) + eps) + wd * wi for mi, vi, wi in zip(m, v, w)]
    w_norm = math.sqrt(sum(x * x for x in w))
    u_norm = math.sqrt(sum(x * x for x in u))
    ratio = 1.0 if w_norm == 0 or u_norm == 0 else min(max(w_norm / u_norm, lo), hi)
    return [wi - lr * ratio * ui for wi, ui in zip(w, u)], m, v, ratio


def test_lamb_two_steps_match_reference_formula() -> None:
    hp = dict(lr=0.01, b1=0.9, b2=0.999, eps=1e-6, wd=0.01, lo=0.01, hi=10.0)
    w = [0.5, -1.0, 2.0, 0.25]
    grads = [[0.1, -0.3, 0.2, 0.05], [-0.2, 0.1, 0.4, 0.0]]
    p = _param(w, grads[0])
    opt = Lamb([p], lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"],
               weight_decay=hp["wd"], min_coeff=hp["lo"], max_coeff=hp["hi"])
    m, v = [0.0] * 4, [0.0] * 4
    for step, g in enumerate(grads, start=1):
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        w, m, v, ratio = _lamb_reference(w, g, m, v, step, **hp)
        assert p.tolist() == pytest.approx(w, abs=1e-12)
        assert opt.get_lamb_coeffs() == pytest.approx([ratio])
        assert opt.state[p]["exp_avg"].tolist() == pytest.approx(m, abs=1e-15)
        assert opt.state[p]["exp_avg_sq"].tolist() == pytest.approx(v, abs=1e-15)
        assert opt.state[p]["step"] == step
    assert 0.01 < ratio < 10.0  # this case is not clamped


@pytest.mark.parametrize("values, expected_ratio", [
    ([100.0, -100.0], 10.0),     # ||w|| / ||u|| = 100 -> clamped to max_coeff
    ([1e-4, 1e-4], 0.01),        # ratio 1e-4 -> clamped to min_coeff
    ([0.0, 0.0], 1.0),           # zero weight norm -> ratio 1
])
def test_lamb_trust_ratio_clamp_and_zero_norm(values: list[float], expected_ratio: float) -> None:
    grad = [0.3, 0.3]
    p = _param(values, grad)
    opt = Lamb([p], lr=0.1)
    opt.step()
    # First step, no weight decay: u = g / (|g| + eps) ~ [1, 1].
    update = [g / (abs(g) + 1e-8) for g in grad]
    assert opt.get_lamb_coeffs() == pytest.approx([expected_ratio])
    assert p.tolist() == pytest.approx(
        [w - 0.1 * expected_ratio * u for w, u in zip(values, update)], abs=1e-12)


def test_lamb_zero_update_norm_uses_ratio_one() -> None:
    p = _param([1.0, 2.0], [0.0, 0.0])
    opt = Lamb([p], lr=0.1)
    opt.step()
    assert opt.get_lamb_coeffs() == [1.0]
    assert p.tolist() == [1.0, 2.0]


# ----------------------------------------------------------------------------- Lion

def test_lion_two_steps_hand_computed() -> None:
    lr, wd, b1, b2 = 0.1, 0.5, 0.9, 0.99
    p = _param([1.0, -1.0, 0.5], [0.3, -0.2, 0.0])
    opt = Lion([p], lr=lr, betas=(b1, b2), weight_decay=wd)
    opt.step()
    # m = 0: sign((1 - b1) g) = sign(g) = [1, -1, 0]
    assert p.tolist() == pytest.approx([1.0 * 0.95 - 0.1, -1.0 * 0.95 + 0.1, 0.5 * 0.95])
    assert opt.state[p]["exp_avg"].tolist() == pytest.approx([0.003, -0.002, 0.0])
    before = p.tolist()
    p.grad = torch.tensor([-0.01, 0.1, 0.2], dtype=torch.float64)
    opt.step()
    # c = 0.9 * m + 0.1 * g = [0.0017, 0.0082, 0.02]: all positive, though g[0] < 0.
    assert p.tolist() == pytest.approx([w * 0.95 - 0.1 for w in before])
    assert opt.state[p]["exp_avg"].tolist() == pytest.approx(
        [0.99 * 0.003 + 0.01 * -0.01, 0.99 * -0.002 + 0.01 * 0.1, 0.01 * 0.2])


def test_lion_param_groups_use_their_own_lr() -> None:
    a, b = _param([0.0], [1.0]), _param([0.0], [-1.0])
    opt = Lion([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.02}])
    opt.step()
    assert a.item() == pytest.approx(-0.1) and b.item() == pytest.approx(0.02)


# ----------------------------------------------------------------------------- both

def _quadratic_losses(opt_cls: type[torch.optim.Optimizer], **kwargs: Any) -> list[float]:
    torch.manual_seed(0)
    target = torch.randn(16) * 0.4
    scale = torch.linspace(0.5, 2.0, 16)
    x = torch.nn.Parameter(torch.zeros(16))
    opt = opt_cls([x], **kwargs)
    losses = []

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (scale * (x - target) ** 2).sum()
        loss.backward()
        return loss

    for _ in range(50):
        losses.append(float(opt.step(closure).detach()))
    return losses


@pytest.mark.parametrize("opt_cls, kwargs", [(Lamb, {"lr": 0.05}), (Lion, {"lr": 0.02})])
def test_quadratic_loss_decreases_with_closure(opt_cls: type[torch.optim.Optimizer],
                                               kwargs: dict[str, float]) -> None:
    losses = _quadratic_losses(opt_cls, **kwargs)
    assert losses[-1] < 0.05 * losses[0]


@pytest.mark.parametrize("opt_cls, state_keys", [(Lamb, {"step", "exp_avg", "exp_avg_sq"}),
                                                  (Lion, {"exp_avg"})])
def test_state_dict_round_trip_continues_identically(opt_cls: type[torch.optim.Optimizer],
                                                     state_keys: set[str]) -> None:
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 3)
    grads = [[torch.randn_like(p) for p in model.parameters()] for _ in range(6)]

    def run(opt: torch.optim.Optimizer, params: list, steps: list) -> None:
        for step_grads in steps:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()

    opt = opt_cls(model.parameters(), lr=0.01, weight_decay=0.1)
    run(opt, list(model.parameters()), grads[:3])
    saved, clone = copy.deepcopy(opt.state_dict()), copy.deepcopy(model)
    assert set(saved["state"][0]) == state_keys
    resumed = opt_cls(clone.parameters(), lr=0.5)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["lr"] == 0.01
    run(opt, list(model.parameters()), grads[3:])
    run(resumed, list(clone.parameters()), grads[3:])
    for a, b in zip(model.parameters(), clone.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("opt_cls", [Lamb, Lion])
def test_low_precision_params_keep_their_dtype(opt_cls: type[torch.optim.Optimizer]) -> None:
    p = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    p.grad = torch.full((8,), 0.5, dtype=torch.bfloat16)
    opt = opt_cls([p], lr=0.1)
    opt.step()
    assert p.dtype == torch.bfloat16 and float(p.detach()[0]) < 1.0
    assert all(t.dtype == torch.bfloat16 for t in opt.state[p].values() if torch.is_tensor(t))


def test_params_without_grad_are_skipped() -> None:
    a, b = _param([1.0], [1.0]), torch.nn.Parameter(torch.tensor([1.0]))
    for opt in (Lamb([a, b], lr=0.1), Lion([a, b], lr=0.1)):
        opt.step()
        assert b.item() == 1.0 and b not in opt.state


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("type_name, params, fragments", [
    ("Adamm", {}, ["unknown optimizer type 'Adamm'", "did you mean 'Adam'", "Lion"]),
    ("Optimizer", {}, ["unknown optimizer type"]),
    ("OneBitAdam", {"freeze_stepp": 10}, ["optimizer 'OneBitAdam'", "did you mean 'freeze_step'"]),
    ("ZeroOneAdam", {}, ["not supported", "'OneBitAdam'", "'Adam'"]),
    ("OneBitLamb", {}, ["not supported", "'OneBitAdam'", "'Lamb'"]),
    ("MuAdam", {}, ["not supported", "mup.MuAdam"]),
    ("MuAdamW", {}, ["not supported", "mup.MuAdamW"]),
    ("MuSGD", {}, ["not supported", "'SGD'"]),
    ("Adam", {"lr_rate": 0.1}, ["optimizer 'Adam'", "'lr_rate'", "did you mean 'lr'",
                                "accepted: lr, bias_correction, betas"]),
    ("Lamb", {"momentum": 0.9}, ["optimizer 'Lamb'", "'momentum'", "max_coeff"]),
    ("SGD", {"betas": [0.9, 0.99]}, ["optimizer 'SGD'", "'betas'", "momentum"]),
    ("Adam", {"max_grad_norm": 1.0}, ["max_grad_norm", "gradient_clipping"]),
    ("AdamW", {"lr": "auto"}, ["optimizer.params.lr", "auto"]),
    ("Adam", {"bias_correction": False}, ["bias_correction=False", "not supported"]),
    ("Lamb", {"amsgrad": True}, ["amsgrad"]),
    ("Lion", {"betas": [0.9, 1.5]}, ["betas[1]=1.5"]),
    ("Lamb", {"min_coeff": 2.0, "max_coeff": 1.0}, ["max_coeff (1.0)", "min_coeff (2.0)"]),
])
def test_errors_name_the_problem(type_name: str, params: dict[str, Any],
                                 fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        build_optimizer(type_name, params, torch.nn.Linear(2, 2).parameters())
    for fragment in fragments:
        assert fragment in str(info.value)


def test_sparse_gradients_are_refused() -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.zeros(4).to_sparse()
    for opt in (Lamb([p]), Lion([p])):
        with pytest.raises(RuntimeError, match="sparse"):
            opt.step()
