"""Switched-on sections deepshard does not act on are refused (when they would change numerics) or
warned about; bad optimizer values and unwritable monitor paths name their config key."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

import pytest

from deepshard.config import ConfigError, load_config
from deepshard.config.inert import warn_unused_pipeline
from deepshard.monitor import MonitorMaster
from deepshard.utils.logging import logger


@pytest.fixture
def warned() -> Iterator[list[str]]:
    messages: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                messages.append(record.getMessage())

    handler = _Keep(logging.DEBUG)
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


def _load(**sections: Any) -> Any:
    return load_config({"train_micro_batch_size_per_gpu": 2, **sections}, dp_world_size=1)


@pytest.mark.parametrize("sections, match", [
    ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, r"torch_autocast.enabled is true.*\"bf16\""),
    ({"amp": {"enabled": True, "opt_level": "O1"}}, r"amp.enabled is true.*Apex"),
    ({"data_types": {"param_dtype": "fp16"}}, r"data_types.param_dtype is 'fp16'.*torch.float32"),
    ({"bf16": {"enabled": True}, "gradient_accumulation_steps": 4, "data_types": {"grad_accum_dtype": "fp16"}},
     r"data_types.grad_accum_dtype is 'fp16'.*4 micro-batches.*torch.bfloat16\) or, in pipelines, in fp32"),
])
def test_switched_on_sections_that_change_numerics_are_refused(sections: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _load(**sections)


def test_fp32_accumulation_passes_the_config() -> None:
    """(refused outside pipelines by the plan check: tests/unit/test_plan.py)"""
    cfg = _load(bf16={"enabled": True}, gradient_accumulation_steps=4, data_types={"grad_accum_dtype": "fp32"})
    assert cfg.data_types.grad_accum_dtype == "fp32"


def test_matching_dtypes_and_switched_off_sections_are_quiet(warned: list[str]) -> None:
    _load(bf16={"enabled": True}, data_types={"param_dtype": "bf16", "grad_accum_dtype": "bfloat16",
                                             "buffer_dtype": "fp32"},
          torch_autocast={"enabled": False, "dtype": "bf16"}, amp={"enabled": False},
          activation_checkpointing={"partition_activations": False}, comet={"enabled": False},
          checkpoint={"tag_validation": "Warn"})
    assert warned == []


def test_ignored_sections_warn_naming_their_keys(warned: list[str]) -> None:
    _load(activation_checkpointing={"partition_activations": True, "number_checkpoints": 2},
          comet={"enabled": True}, checkpoint={"use_node_local_storage": True, "load_universal": True,
                                               "tag_validation": "fail"},
          data_types={"grad_accum_dtype": "fp32"}, bf16={"enabled": True}, fp16={"auto_cast": True})
    text = "\n".join(warned)
    assert "activation_checkpointing.partition_activations, activation_checkpointing.number_checkpoints" in text
    assert "comet.enabled: ignored" in text
    assert "checkpoint.use_node_local_storage: ignored" in text
    assert "tag_validation" not in text  # acted on: ranks passing different tags to save_checkpoint fail
    assert "checkpoint.load_universal: ignored" in text
    assert "data_types.grad_accum_dtype: ignored" in text and "gradient_accumulation_steps 1" in text
    assert "fp16.auto_cast: ignored" in text and "only in fp16 training" in text  # DeepSpeed casts to fp16 anyway
    assert len(warned) == 6


def test_null_batch_key_warns_with_the_derived_value(warned: list[str]) -> None:
    cfg = load_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                       "gradient_accumulation_steps": None}, dp_world_size=2)
    assert cfg.gradient_accumulation_steps == 2
    assert warned == [m for m in warned if m.startswith("gradient_accumulation_steps is null")] and len(warned) == 1
    assert "derived as 2" in warned[0]


@pytest.mark.parametrize("params, match", [
    ({"lr": "1e-3"}, r"optimizer.params.lr = '1e-3' \(str\) is invalid: expected a number \(write 1e-3 without"),
    ({"lr": -1e-3}, r"optimizer.params.lr = -0.001 is invalid: expected a finite number >= 0"),
    ({"eps": -1e-8}, r"optimizer.params.eps = -1e-08 is invalid"),
    ({"weight_decay": True}, r"optimizer.params.weight_decay = True \(bool\)"),
    ({"betas": 0.9}, r"optimizer.params.betas = 0.9 is invalid: expected two numbers in \[0, 1\)"),
    ({"betas": [0.9, "0.999"]}, r"optimizer.params.betas = \[0.9, '0.999'\]"),
    ({"betas": [0.9, 1.0]}, r"optimizer.params.betas = \[0.9, 1.0\]"),
])
def test_bad_optimizer_values_name_the_key(params: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _load(optimizer={"type": "AdamW", "params": params})


def test_good_optimizer_values_load() -> None:
    cfg = _load(optimizer={"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                        "weight_decay": 0}})
    assert cfg.optimizer.params["betas"] == [0.9, 0.95]


@pytest.mark.parametrize("key", ["csv_monitor", "tensorboard"])
def test_unwritable_monitor_path_names_the_key(tmp_path: Path, key: str) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cfg = _load(**{key: {"enabled": True, "output_path": str(blocker / "logs"), "job_name": "run"}})
    if key == "tensorboard":
        pytest.importorskip("torch.utils.tensorboard")
    with pytest.raises(ValueError, match=rf"{key}.output_path = '.*a_file/logs': cannot create the log "
                                         rf"directory .*give a writable directory in {key}.output_path"):
        MonitorMaster(cfg.tensorboard, cfg.csv_monitor, cfg.wandb, rank=0)


def test_pipeline_section_with_a_plain_model_warns(warned: list[str]) -> None:
    import torch

    cfg = _load(pipeline={"stages": 2})
    warn_unused_pipeline(cfg, torch.nn.Linear(2, 2))
    assert len(warned) == 1 and warned[0].startswith("pipeline: ignored") and "Linear is not one" in warned[0]
    warned.clear()
    warn_unused_pipeline(_load(), torch.nn.Linear(2, 2))
    assert warned == []
