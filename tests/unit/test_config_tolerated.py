"""Top-level keys DeepSpeed ignores (dotted keys, keys of no section): dropped with one warning line.

The reference is DeepSpeed 0.19.8's own behaviour, observed with its ``DeepSpeedConfig`` on the same dict:
the three dotted keys TRL sends leave ``reduce_bucket_size`` 500000000, the persistence threshold 100000
and the prefetch bucket 50000000 (its defaults), an unknown top-level key is ignored, and an unknown key
inside a section is refused. Pure logic, no process group.
"""
from __future__ import annotations

import logging

import pytest

from deepshard.config import ConfigError, load_config

# what TRL's prepare_deepspeed adds for its reference model (hidden size 64)
TRL_DOTTED = {"zero_optimization.reduce_bucket_size": 64 * 64,
              "zero_optimization.stage3_param_persistence_threshold": 10 * 64,
              "zero_optimization.stage3_prefetch_bucket_size": 0.9 * 64 * 64}


def test_dotted_top_level_keys_are_ignored_as_deepspeed_does_with_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="deepshard")
    cfg = load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3}, **TRL_DOTTED}, 1)
    zero = cfg.zero_optimization
    # DeepSpeed 0.19.8 on this dict: 500000000, 100000, 50000000 (the nested defaults; the dotted keys unread);
    # deepshard's prefetch default is "not given" (None: sized from the model, at most 50000000)
    assert (zero.reduce_bucket_size, zero.stage3_param_persistence_threshold,
            zero.stage3_prefetch_bucket_size) == (500_000_000, 100_000, None)
    lines = [r.getMessage() for r in caplog.records if "ignoring keys" in r.getMessage()]
    assert len(lines) == 1, lines
    for key in TRL_DOTTED:
        assert repr(key) in lines[0]
    assert 'nest it: {"zero_optimization": {"reduce_bucket_size": ...}}' in lines[0]
    assert cfg.raw["zero_optimization.reduce_bucket_size"] == 64 * 64  # raw keeps what was given


def test_unknown_top_level_key_unlike_any_known_one_is_ignored_with_the_dotted_ones(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="deepshard")
    cfg = load_config({"train_batch_size": 2, "my_tool_run_id": "abc", "fp16.enabled": True}, 1)
    assert not cfg.fp16.enabled  # a dotted key sets nothing, as in DeepSpeed
    lines = [r.getMessage() for r in caplog.records if "ignoring keys" in r.getMessage()]
    assert len(lines) == 1 and "'my_tool_run_id'" in lines[0] and "'fp16.enabled'" in lines[0]


def test_a_config_without_such_keys_warns_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="deepshard")
    load_config({"train_batch_size": 2, "zero_optimization": {"stage": 2}}, 1)
    assert "ignoring keys" not in caplog.text


def test_typos_stay_errors_at_the_top_level_and_inside_sections() -> None:
    # a near-miss of a real key loses a setting silently in DeepSpeed; deepshard names it
    with pytest.raises(ConfigError, match=r"unknown config key 'gradient_cliping'; did you mean 'gradient_clipping'"):
        load_config({"train_batch_size": 2, "gradient_cliping": 1.0}, 1)
    # inside a section DeepSpeed refuses unknown keys too (pydantic extra_forbidden)
    with pytest.raises(ConfigError, match=r"unknown config key 'zero_optimization.reduce_bucket_sise'"):
        load_config({"train_batch_size": 2, "zero_optimization": {"reduce_bucket_sise": 1}}, 1)
