"""The fp16 loss scaler's schedule, step by step against hand-worked values."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from deepshard.precision import DynamicLossScaler, StaticLossScaler, make_loss_scaler


def test_overflow_halves_after_hysteresis_runs_out() -> None:
    s = DynamicLossScaler(scale=1024.0, scale_window=1000, hysteresis=2)
    s.update(True)  # first overflow uses up the hysteresis allowance
    assert s.scale == 1024.0
    s.update(True)
    assert s.scale == 512.0
    s.update(True)
    assert s.scale == 256.0


def test_hysteresis_one_halves_immediately_and_min_scale_holds() -> None:
    s = DynamicLossScaler(scale=4.0, hysteresis=1, min_scale=2.0)
    s.update(True)
    assert s.scale == 2.0
    s.update(True)
    assert s.scale == 2.0  # never below min_loss_scale


def test_scale_doubles_after_clean_window() -> None:
    s = DynamicLossScaler(scale=8.0, scale_window=3, hysteresis=1)
    s.update(True)  # iteration 0 overflows -> 4
    assert s.scale == 4.0
    s.update(False)  # iteration 1: 1 since overflow
    s.update(False)  # iteration 2
    assert s.scale == 4.0
    s.update(False)  # iteration 3: 3 clean iterations since the overflow -> x2
    assert s.scale == 8.0


def test_consecutive_hysteresis_restores_allowance() -> None:
    s = DynamicLossScaler(scale=64.0, scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    s.update(True)
    s.update(False)  # allowance restored
    s.update(True)
    assert s.scale == 64.0
    plain = DynamicLossScaler(scale=64.0, scale_window=100, hysteresis=2)
    plain.update(True)
    plain.update(False)
    plain.update(True)
    assert plain.scale == 32.0


def test_state_round_trip() -> None:
    s = DynamicLossScaler(scale=256.0, scale_window=5, hysteresis=2)
    for overflow in (True, False, True, False, False):
        s.update(overflow)
    t = DynamicLossScaler(scale=1.0, scale_window=5, hysteresis=2)
    t.load_state_dict(s.state_dict())
    for overflow in (False, True, False, False, False, False, False):
        s.update(overflow)
        t.update(overflow)
        assert s.scale == t.scale


def test_factory_from_config() -> None:
    cfg = SimpleNamespace(enabled=True, loss_scale=0, initial_scale_power=12, loss_scale_window=10,
                          hysteresis=3, consecutive_hysteresis=False, min_loss_scale=1)
    s = make_loss_scaler(cfg)
    assert isinstance(s, DynamicLossScaler) and s.scale == 4096.0 and s.hysteresis == 3
    cfg.loss_scale = 128
    assert make_loss_scaler(cfg) == StaticLossScaler(128.0)
    assert make_loss_scaler(SimpleNamespace(enabled=False)).scale == 1.0


def test_bad_values_are_rejected() -> None:
    with pytest.raises(ValueError, match="hysteresis"):
        DynamicLossScaler(hysteresis=0)
