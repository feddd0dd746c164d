"""Config loading: batch arithmetic, sources (dict / file / base64), error messages, "auto", CLI args.

Pure logic, no process group. Section-level details are in test_config_sections.py.
"""
from __future__ import annotations

import argparse
import base64
import copy
import json
import logging
import pathlib
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from deepshard.config import (ConfigError, DeepShardConfig, add_config_arguments, dtype_from_name,
                              load_config, resolve_config_source)
from deepshard.utils.logging import logger

SEED = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.001, "momentum": 0.9}},
        "fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}


@pytest.fixture
def log_records() -> Iterator[list[logging.LogRecord]]:
    """Records sent to the 'deepshard' logger (it does not propagate, so caplog cannot see them)."""
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler, old_level = _Keep(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def _batch(cfg: DeepShardConfig) -> tuple[int, int, int]:
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


# ------------------------------------------------------------------------------ batch arithmetic

@pytest.mark.parametrize("given, dp, expected", [
    # all three given (consistent)
    ({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 1, (4, 2, 2)),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 2, (8, 2, 2)),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 4, (16, 2, 2)),
    # tbs + micro -> gas = tbs // (micro * dp)
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 1, (32, 4, 8)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4, (32, 4, 2)),
    # tbs + gas -> micro = tbs // (gas * dp)
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 1, (32, 16, 2)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2, (32, 8, 2)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    # micro + gas -> tbs = micro * gas * dp
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 1, (15, 3, 5)),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 2, (30, 3, 5)),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 4, (60, 3, 5)),
    # only tbs -> gas = 1, micro = tbs // dp
    ({"train_batch_size": 24}, 1, (24, 24, 1)),
    ({"train_batch_size": 24}, 2, (24, 12, 1)),
    ({"train_batch_size": 24}, 4, (24, 6, 1)),
    # only micro -> gas = 1, tbs = micro * dp
    ({"train_micro_batch_size_per_gpu": 5}, 1, (5, 5, 1)),
    ({"train_micro_batch_size_per_gpu": 5}, 2, (10, 5, 1)),
    ({"train_micro_batch_size_per_gpu": 5}, 4, (20, 5, 1)),
])
def test_batch_arithmetic(given: dict, dp: int, expected: tuple[int, int, int]) -> None:
    assert _batch(load_config(given, dp)) == expected


def test_batch_mismatch_message_prints_the_arithmetic() -> None:
    given = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    with pytest.raises(ConfigError) as err:
        load_config(given, 2)
    assert str(err.value) == (
        "train_batch_size (32) must equal train_micro_batch_size_per_gpu (4) * gradient_accumulation_steps (2) "
        "* data-parallel size (2) = 16; give any two of the three and the third is derived")


@pytest.mark.parametrize("given, dp, product", [
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, 1, "= 8"),   # gas = 10 // 4 = 2
    ({"train_batch_size": 10, "gradient_accumulation_steps": 3}, 1, "= 9"),      # micro = 10 // 3 = 3
    ({"train_batch_size": 10}, 4, "= 8"),                                         # micro = 10 // 4 = 2
])
def test_batch_integer_division_remainder_is_caught(given: dict, dp: int, product: str) -> None:
    with pytest.raises(ConfigError, match="must equal") as err:
        load_config(given, dp)
    assert product in str(err.value) and "derived" in str(err.value)


def test_batch_derived_zero_and_nonpositive_values_are_errors() -> None:
    with pytest.raises(ConfigError, match=r"train_micro_batch_size_per_gpu must be greater than 0, got 0"):
        load_config({"train_batch_size": 2}, 4)  # 2 // 4 = 0
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps must be greater than 0, got -1"):
        load_config({"train_batch_size": 8, "gradient_accumulation_steps": -1}, 1)


@pytest.mark.parametrize("given", [{}, {"gradient_accumulation_steps": 4}])
def test_batch_neither_size_given(given: dict) -> None:
    with pytest.raises(ConfigError, match="Either train_batch_size or train_micro_batch_size_per_gpu "
                                          "needs to be provided"):
        load_config(given, 1)


# ------------------------------------------------------------------------------------ "auto"

def test_auto_batch_keys_are_derived() -> None:
    cfg = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                       "gradient_accumulation_steps": "auto"}, 2)
    assert _batch(cfg) == (8, 4, 1)
    assert cfg.raw["train_batch_size"] == "auto"  # raw keeps what the user wrote


def test_auto_batch_keys_that_cannot_be_derived_name_the_keys_and_hf() -> None:
    hf = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2}
    with pytest.raises(ConfigError) as err:
        load_config(hf, 2)
    msg = str(err.value)
    assert "train_batch_size, train_micro_batch_size_per_gpu are \"auto\"" in msg
    assert "Hugging Face Trainer/Accelerate" in msg and "give numbers" in msg


def test_auto_in_sections_takes_the_default(log_records: list[logging.LogRecord]) -> None:
    cfg = load_config({"train_batch_size": 4, "gradient_clipping": "auto",
                       "fp16": {"enabled": "auto", "loss_scale_window": "auto"},
                       "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                             "stage3_prefetch_bucket_size": "auto",
                                             "stage3_param_persistence_threshold": "auto"}}, 1)
    assert cfg.gradient_clipping == 1.0
    assert cfg.fp16.enabled is False and cfg.fp16.loss_scale_window == 1000
    zero = cfg.zero_optimization
    assert (zero.reduce_bucket_size, zero.prefetch_bucket_size, zero.param_persistence_threshold) == \
        (500_000_000, None, 100_000)  # None: derived from the model (one module ahead)
    debug = [r.getMessage() for r in log_records if r.levelno == logging.DEBUG]
    assert any("zero_optimization.reduce_bucket_size' is 'auto'" in m for m in debug)


@pytest.mark.parametrize("section, params, key", [
    ("optimizer", {"lr": "auto", "weight_decay": 0.0}, "optimizer.params.lr"),
    ("optimizer", {"lr": 1e-3, "betas": "auto"}, "optimizer.params.betas"),
    ("scheduler", {"warmup_num_steps": "auto"}, "scheduler.params.warmup_num_steps"),
])
def test_auto_in_optimizer_or_scheduler_params_is_rejected(section: str, params: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 4, section: {"type": "WarmupLR" if section == "scheduler" else "AdamW",
                                                       "params": params}}, 1)
    assert str(err.value) == (
        f"{key} is 'auto': 'auto' is filled in by the Hugging Face Trainer/Accelerate from their own "
        "arguments; deepshard.initialize has nothing to fill it from; give a number")


# ------------------------------------------------------------------------------ error messages

def test_unknown_top_level_key_names_it_and_suggests() -> None:
    with pytest.raises(ConfigError, match=r"^unknown config key 'optimiser'; did you mean 'optimizer'\?$"):
        load_config({"train_batch_size": 4, "optimiser": {"type": "SGD"}}, 1)


def test_unknown_nested_key_gives_full_path_and_suggestion() -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 4, "zero_optimization": {"stgae": 2}}, 1)
    assert str(err.value) == "unknown config key 'zero_optimization.stgae'; did you mean 'stage'?"
    with pytest.raises(ConfigError, match=r"'zero_optimization\.offload_param\.devise'; did you mean 'device'"):
        load_config({"train_batch_size": 4, "zero_optimization": {"offload_param": {"devise": "cpu"}}}, 1)
    # the suggestion comes from the section's names and aliases
    with pytest.raises(ConfigError, match=r"did you mean 'stage3_max_live_parameters'"):
        load_config({"train_batch_size": 4, "zero_optimization": {"stage3_max_live_params": 1}}, 1)


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 4, "fp16": {"xyzzy": 1}}, 1)
    assert "unknown config key 'fp16.xyzzy'; valid keys in fp16: auto_cast," in str(err.value)


def test_type_errors_name_path_value_and_expectation() -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 4, "fp16": {"loss_scale": "high"},
                     "zero_optimization": {"stage": 5, "reduce_bucket_size": 1.5}}, 1)
    msg = str(err.value)
    assert msg.startswith("3 problems in the config:")
    assert "config key 'fp16.loss_scale' = 'high' (str) is invalid: Input should be a valid number" in msg
    assert "config key 'zero_optimization.stage' = 5 (int) is invalid" in msg
    assert "'zero_optimization.reduce_bucket_size' = 1.5 (float) is invalid: expected a whole number" in msg


def test_type_strictness_rules() -> None:
    with pytest.raises(ConfigError, match="train_batch_size' = '4' \\(str\\)"):
        load_config({"train_batch_size": "4"}, 1)  # DeepSpeed reads top-level keys as given, and fails too
    # in a section, a number written as a string is converted, as DeepSpeed's pydantic sections convert it
    cfg = load_config({"train_batch_size": 4, "fp16": {"enabled": True, "loss_scale": "3", "hysteresis": " 4"},
                       "zero_optimization": {"stage": "2", "reduce_bucket_size": "500000000"}}, 1)
    assert (cfg.fp16.loss_scale, cfg.fp16.hysteresis) == (3.0, 4) and isinstance(cfg.fp16.loss_scale, float)
    assert (cfg.zero_optimization.stage, cfg.zero_optimization.reduce_bucket_size) == (2, 500_000_000)
    with pytest.raises(ConfigError, match="'fp16.hysteresis' = '4.5' \\(str\\)"):  # not a whole number
        load_config({"train_batch_size": 4, "fp16": {"hysteresis": "4.5"}}, 1)
    with pytest.raises(ConfigError, match="fp16.enabled' = 1 \\(int\\)"):
        load_config({"train_batch_size": 4, "fp16": {"enabled": 1}}, 1)
    cfg = load_config({"train_batch_size": 4, "gradient_clipping": 2,
                       "zero_optimization": {"reduce_bucket_size": 5e8, "allgather_bucket_size": 2e8}}, 1)
    assert cfg.gradient_clipping == 2.0 and isinstance(cfg.gradient_clipping, float)
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert isinstance(cfg.zero_optimization.allgather_bucket_size, int)


# ------------------------------------------------------------------------------------- sources

def test_seed_config_from_product_md_loads_with_dp2() -> None:
    cfg = load_config(SEED, 2)
    assert _batch(cfg) == (4, 2, 1)
    assert (cfg.optimizer.type, cfg.optimizer.params) == ("SGD", {"lr": 0.001, "momentum": 0.9})
    assert cfg.fp16_enabled and not cfg.bf16_enabled and cfg.model_dtype == torch.float16
    assert cfg.zero_stage == 2 and cfg.zero_optimization.overlap_comm is False
    assert cfg.gradient_clipping == 1.0 and cfg.scheduler is None


def test_dict_source_is_copied_not_mutated() -> None:
    given = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
             "zero_optimization": {"stage": 3, "cpu_offload": True, "reduce_bucket_size": "auto"}}
    before = copy.deepcopy(given)
    cfg = load_config(given, 2)
    assert given == before
    assert cfg.raw == before and cfg.raw is not given
    cfg.raw["zero_optimization"]["stage"] = 0
    assert given["zero_optimization"]["stage"] == 3


def test_path_source_str_and_pathlike(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(SEED))
    assert _batch(load_config(str(path), 2)) == (4, 2, 1)
    assert load_config(path, 4).train_micro_batch_size_per_gpu == 1


def test_file_errors_name_the_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"train_batch_size": 4, "zero_optimization": {"stgae": 1}}))
    with pytest.raises(ConfigError, match=r"did you mean 'stage'\? \(config file '.*bad.json'\)"):
        load_config(str(path), 1)


def test_duplicate_json_key_in_file_is_an_error(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{\n  "train_batch_size": 4,\n  "zero_optimization": {\n    "stage": 2,\n'
                    '    "stage": 3\n  }\n}\n')
    with pytest.raises(ConfigError) as err:
        load_config(str(path), 1)
    msg = str(err.value)
    assert "duplicate key 'stage'" in msg and str(path) in msg and "lines 4, 5" in msg


def test_invalid_json_reports_line_and_column(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "broken.json"  # not Hjson either (a file that is Hjson is read where hjson is installed)
    path.write_text('{\n  "train_batch_size": 4,\n  "fp16": {"enabled": true]\n}\n')
    with pytest.raises(ConfigError, match=r"broken.json' is not valid JSON: .* at line 3, column 27"):
        load_config(str(path), 1)


HJSON_TEXT = '{\n  # DeepSpeed reads config files as Hjson\n  train_batch_size: 4\n  zero_optimization: {stage: 2}\n}\n'


def test_hjson_config_file_is_read_where_hjson_is_installed(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("hjson", reason="the optional hjson package is not installed")
    path = tmp_path / "ds.json"
    path.write_text(HJSON_TEXT)
    cfg = load_config(str(path), 2)
    assert _batch(cfg) == (4, 2, 1) and cfg.zero_stage == 2
    path.write_text('{\n  a: 1\n  a: 2\n}\n')
    with pytest.raises(ConfigError, match="duplicate key 'a'"):
        load_config(str(path), 1)


def test_hjson_config_file_without_hjson_says_to_install_it(tmp_path: pathlib.Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hjson", None)  # import hjson raises ImportError
    path = tmp_path / "ds.json"
    path.write_text(HJSON_TEXT)
    with pytest.raises(ConfigError, match=r"(?s)is not valid JSON: .* at line 2.*pip install hjson"):
        load_config(str(path), 1)


def test_missing_file_is_a_clear_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match=r"config file '.*nope.json' does not exist"):
        load_config(str(tmp_path / "nope.json"), 1)


def test_base64_source() -> None:
    text = json.dumps(SEED)
    standard = base64.b64encode(text.encode()).decode()
    urlsafe_unpadded = base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")
    for encoded in (standard, urlsafe_unpadded):
        cfg = load_config(encoded, 2)
        assert _batch(cfg) == (4, 2, 1) and cfg.zero_stage == 2


def test_garbage_string_and_none_sources() -> None:
    with pytest.raises(ConfigError, match="not base64-encoded JSON either"):
        load_config("definitely not a config", 1)
    with pytest.raises(ConfigError, match=r"config=.*--deepspeed_config.*add_config_arguments|"
                                          r"add_config_arguments.*--deepspeed_config"):
        load_config(None, 1)
    with pytest.raises(ConfigError, match="dp_world_size must be an int >= 1, got 0"):
        load_config(SEED, 0)


def test_model_validate_directly_uses_context_dp() -> None:
    cfg = DeepShardConfig.model_validate({"train_batch_size": 16}, context={"dp_world_size": 4})
    assert _batch(cfg) == (16, 4, 1)
    assert _batch(DeepShardConfig.model_validate({"train_batch_size": 16})) == (16, 16, 1)


# --------------------------------------------------------------------------- dtypes and CLI

@pytest.mark.parametrize("name, dtype", [
    ("fp32", torch.float32), ("float32", torch.float32), ("float", torch.float32),
    ("fp16", torch.float16), ("float16", torch.float16), ("half", torch.float16),
    ("bf16", torch.bfloat16), ("BFloat16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
])
def test_dtype_from_name(name: str, dtype: torch.dtype) -> None:
    assert dtype_from_name(name) is dtype


def test_dtype_from_name_rejects_unknown() -> None:
    with pytest.raises(ConfigError, match="unknown dtype name 'fp8'; valid names: fp32"):
        dtype_from_name("fp8")
    with pytest.raises(ConfigError, match="must be a string"):
        dtype_from_name(16)  # type: ignore[arg-type]


def test_add_config_arguments_parses_deepspeed_flags() -> None:
    parser = add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "x.json"])
    assert args.deepspeed is True and args.deepspeed_config == "x.json"
    assert args.deepscale is False and args.deepscale_config is None
    assert any(g.title == "DeepSpeed" for g in parser._action_groups)
    defaults = parser.parse_args([])
    assert defaults.deepspeed is False and defaults.deepspeed_config is None


def test_resolve_config_source(log_records: list[logging.LogRecord], tmp_path: pathlib.Path) -> None:
    assert resolve_config_source(None, None) is None
    assert resolve_config_source(SimpleNamespace(deepspeed_config=None), None) is None
    assert resolve_config_source(SimpleNamespace(deepspeed_config="a.json"), None) == "a.json"
    assert resolve_config_source(None, SEED) is SEED
    assert resolve_config_source(object(), tmp_path / "c.json") == str(tmp_path / "c.json")
    assert resolve_config_source(SimpleNamespace(deepscale_config="old.json"), None) == "old.json"
    assert any("deprecated" in r.getMessage() for r in log_records if r.levelno == logging.WARNING)
    with pytest.raises(ConfigError, match="pass only one"):
        resolve_config_source(SimpleNamespace(deepspeed_config="a.json"), {"train_batch_size": 1})


def test_elastic_checkpoint_at_stage_3_warns_it_is_deprecated(log_records: list[logging.LogRecord]) -> None:
    """DeepSpeed 0.19.8 warns "ZeRO-3 elastic checkpointing is deprecated"; deepshard says so too (and that
    its checkpoints load on any data-parallel size), once, and not at stage 2 where the key is used."""
    load_config({**SEED, "zero_optimization": {"stage": 2, "elastic_checkpoint": True}}, 1)
    assert not [r for r in log_records if "elastic" in r.getMessage()]
    load_config({**SEED, "zero_optimization": {"stage": 3, "elastic_checkpoint": True}}, 1)
    lines = [r.getMessage() for r in log_records if "elastic" in r.getMessage()]
    assert len(lines) == 1 and "elastic checkpointing is deprecated" in lines[0].lower(), lines
