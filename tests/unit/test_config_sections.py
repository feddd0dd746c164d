"""Config sections: a realistic full DeepSpeed config, ZeRO aliases and deprecated keys, precision,
unimplemented sections, and cross-section checks. Pure logic, no process group."""
from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Iterator
import sys

import pytest
import torch

from deepshard.config import ConfigError, DeepShardConfig, load_config
from deepshard.config.unimplemented import UNIMPLEMENTED_KEYS
from deepshard.utils.logging import logger

BIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "steps_per_print": 50,
    "wall_clock_breakdown": False,
    "gradient_clipping": 0.5,
    "prescale_gradients": False,
    "gradient_predivide_factor": 2,
    "communication_data_type": "fp32",
    "gradient_allreduce_op": "Mean",
    "dataloader_drop_last": True,
    "zero_allow_untested_optimizer": True,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                               "weight_decay": 0.1, "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                                      "warmup_num_steps": 100, "total_num_steps": 1000,
                                                      "warmup_type": "linear"}},
    "bf16": {"enabled": True, "immediate_grad_update": True},
    "fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
             "hysteresis": 2, "min_loss_scale": 1},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.5},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 6,
                          "buffer_size": 2e8, "max_in_cpu": 1e9},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": 1e6,
        "stage3_prefetch_bucket_size": 9e5,
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
        "round_robin_gradients": False,
        "leaf_module": {"classes": ["MixtralSparseMoeBlock"]},
    },
    "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                 "contiguous_memory_optimization": False, "number_checkpoints": 4,
                                 "synchronize_checkpoint_boundary": False, "profile": False},
    "flops_profiler": {"enabled": True, "profile_step": 3, "module_depth": -1, "top_modules": 2,
                       "detailed": False, "output_file": None},
    "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1, "single_submit": False,
            "overlap_events": True},
    "comms_logger": {"enabled": True, "verbose": False, "prof_all": False, "prof_ops": ["all_reduce"],
                     "debug": False},
    "tensorboard": {"enabled": True, "output_path": "runs/", "job_name": "big"},
    "csv_monitor": {"enabled": True, "output_path": "csv/", "job_name": "big"},
    "wandb": {"enabled": False, "project": "p", "team": None, "group": None},
    "comet": {"enabled": False, "samples_log_interval": 10, "project": "x", "online": False},
    "checkpoint": {"tag_validation": "fail", "load_universal": False, "use_node_local_storage": True,
                   "parallel_write": {"pipeline_stage": True}},
    "data_types": {"grad_accum_dtype": "bf16"},
    "torch_autocast": {"enabled": False, "dtype": "bfloat16",
                       "lower_precision_safe_modules": ["torch.nn.Linear"]},
    "pipeline": {"stages": "auto", "partition": "parameters", "activation_checkpoint_interval": 1},
    "elasticity": {"enabled": False, "max_train_batch_size": 64},
    "timers": {"throughput": {"enabled": True, "synchronized": True}},
}


@pytest.fixture
def warnings_logged() -> Iterator[list[str]]:
    """Warning messages sent to the 'deepshard' logger during the test."""
    messages: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                messages.append(record.getMessage())

    handler = _Keep(logging.DEBUG)
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


def test_big_realistic_config_loads(tmp_path: pathlib.Path, warnings_logged: list[str]) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(BIG, indent=2))
    cfg = load_config(str(path), 4)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (32, 2, 4)
    assert cfg.bf16_enabled and cfg.model_dtype == torch.bfloat16 and cfg.bf16.check_grad_overflow is True
    assert cfg.fp16.initial_scale_power == 12 and cfg.fp16.initial_dynamic_scale() == 4096.0
    assert cfg.gradient_allreduce_op == "mean" and cfg.gradient_predivide_factor == 2.0
    assert cfg.scheduler.type == "WarmupDecayLR" and cfg.scheduler.params["total_num_steps"] == 1000
    zero = cfg.zero_optimization
    assert cfg.zero_stage == 3 and zero.overlap_comm is True
    assert (zero.offload_optimizer_device, zero.offload_optimizer.ratio) == ("cpu", 0.5)
    assert (zero.offload_param.device, zero.offload_param.nvme_path) == ("nvme", "/local_nvme")
    assert zero.offload_param.buffer_size == 200_000_000 and zero.offload_param.pin_memory is True
    assert zero.prefetch_bucket_size == zero.stage3_prefetch_bucket_size == 900_000
    assert zero.param_persistence_threshold == 10_000 and zero.stage3_gather_16bit_weights_on_model_save
    assert zero.model_persistence_threshold == sys.maxsize
    assert zero.leaf_module.classes == ["MixtralSparseMoeBlock"]
    assert cfg.activation_checkpointing.number_checkpoints == 4
    assert cfg.flops_profiler.profile_step == 3 and cfg.aio.queue_depth == 32
    assert cfg.comms_logger.prof_ops == ["all_reduce"] and cfg.tensorboard.job_name == "big"
    assert cfg.checkpoint.tag_validation == "Fail" and cfg.checkpoint.parallel_write.pipeline_stage
    assert cfg.torch_autocast.dtype == "bfloat16" and cfg.pipeline.stages == "auto"
    assert cfg.elasticity == {"enabled": False, "max_train_batch_size": 64}
    assert not any("not implemented" in m for m in warnings_logged)  # disabled sections stay quiet


def test_defaults_match_deepspeed() -> None:
    cfg = load_config({"train_batch_size": 1}, 1)
    fp16, zero = cfg.fp16, cfg.zero_optimization
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window,
            fp16.hysteresis, fp16.min_loss_scale) == (False, 0.0, 16, 1000, 2, 1.0)
    assert (zero.stage, zero.overlap_comm, zero.reduce_bucket_size, zero.allgather_bucket_size,
            zero.sub_group_size, zero.max_live_parameters) == (0, False, 500_000_000, 500_000_000,
                                                               1_000_000_000, 1_000_000_000)
    assert zero.offload_param is None and zero.offload_optimizer_device == "none"
    assert (cfg.wandb.project, cfg.tensorboard.job_name, cfg.comms_logger.prof_all) == \
        ("deepspeed", "DeepSpeedJobName", True)
    assert (cfg.aio.block_size, cfg.aio.queue_depth, cfg.aio.overlap_events) == (1_048_576, 8, True)
    assert (cfg.flops_profiler.detailed, cfg.flops_profiler.module_depth) == (True, -1)
    assert cfg.steps_per_print is None and cfg.gradient_allreduce_op == "mean"
    assert cfg.zero_force_ds_cpu_optimizer is True and cfg.managed_gradient_accumulation is True
    assert cfg.model_dtype == torch.float32 and not cfg.zero_enabled
    # DeepSpeed reads these top-level flags as plain values tested for truth: 1 / 0 stand for true / false
    flags = load_config({"train_batch_size": 1, "zero_allow_untested_optimizer": 1,
                         "zero_force_ds_cpu_optimizer": 0}, 1)
    assert flags.zero_allow_untested_optimizer is True and flags.zero_force_ds_cpu_optimizer is False
    for wrong in (2, "1", 1.0):
        with pytest.raises(ConfigError, match="zero_allow_untested_optimizer"):
            load_config({"train_batch_size": 1, "zero_allow_untested_optimizer": wrong}, 1)


@pytest.mark.parametrize("stage, given, expected", [(3, None, True), (2, None, False), (1, None, False),
                                                    (3, False, False), (2, True, True)])
def test_overlap_comm_resolution(stage: int, given: bool | None, expected: bool) -> None:
    zero = {"stage": stage} if given is None else {"stage": stage, "overlap_comm": given}
    assert load_config({"train_batch_size": 1, "zero_optimization": zero}, 1).zero_optimization.overlap_comm is expected


def test_zero_stage3_keys_accept_both_spellings() -> None:
    prefixed = load_config({"train_batch_size": 1, "zero_optimization": {
        "stage3_max_reuse_distance": 7, "stage3_gather_16bit_weights_on_model_save": True}}, 1)
    plain = load_config({"train_batch_size": 1, "zero_optimization": {
        "max_reuse_distance": 7, "gather_16bit_weights_on_model_save": True}}, 1)
    for cfg in (prefixed, plain):
        assert cfg.zero_optimization.max_reuse_distance == cfg.zero_optimization.stage3_max_reuse_distance == 7
        assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    with pytest.raises(ConfigError, match="two spellings of the same setting"):
        load_config({"train_batch_size": 1, "zero_optimization": {"max_reuse_distance": 1,
                                                                  "stage3_max_reuse_distance": 2}}, 1)


def test_zero_deprecated_keys_are_mapped(warnings_logged: list[str]) -> None:
    cfg = load_config({"train_batch_size": 1, "zero_optimization": {
        "stage": 3, "cpu_offload": True, "cpu_offload_param": True,
        "stage3_gather_fp16_weights_on_model_save": True}}, 1)
    zero = cfg.zero_optimization
    assert zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.pin_memory is True
    assert zero.offload_param.device == "cpu" and zero.offload_param.buffer_count == 5
    assert zero.gather_16bit_weights_on_model_save is True
    assert sum("deprecated" in m for m in warnings_logged) == 3
    with pytest.raises(ConfigError, match="remove cpu_offload and keep offload_optimizer"):
        load_config({"train_batch_size": 1, "zero_optimization": {
            "cpu_offload": True, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}}, 1)


def test_zero_optimization_bool_form_is_accepted() -> None:
    assert load_config({"train_batch_size": 1, "zero_optimization": True}, 1).zero_stage == 1
    assert load_config({"train_batch_size": 1, "zero_optimization": False}, 1).zero_stage == 0


def test_offload_validation() -> None:
    with pytest.raises(ConfigError, match="offload_param.device is 'nvme' but .*nvme_path is not set"):
        load_config({"train_batch_size": 1, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, 1)
    with pytest.raises(ConfigError, match=r"ratio \(0.3\) below 1.0 .* needs zero_optimization.stage 3, got stage 2"):
        load_config({"train_batch_size": 1, "zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}, 1)
    with pytest.raises(ConfigError, match=r"offload_optimizer.device' = 'gpu' .*'none', 'cpu' or 'nvme'"):
        load_config({"train_batch_size": 1, "zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, 1)


def test_fp16_and_bf16_together_is_an_error() -> None:
    with pytest.raises(ConfigError, match="fp16.enabled and bf16.enabled are both true"):
        load_config({"train_batch_size": 1, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, 1)


def test_bfloat16_alias() -> None:
    cfg = load_config({"train_batch_size": 1, "bfloat16": {"enabled": True}}, 1)
    assert cfg.bf16_enabled and cfg.model_dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="'bfloat16' and 'bf16' are two spellings"):
        load_config({"train_batch_size": 1, "bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, 1)


def test_dtype_fields_are_validated() -> None:
    assert load_config({"train_batch_size": 1, "communication_data_type": "bf16"}, 1).communication_data_type == "bf16"
    with pytest.raises(ConfigError, match="'communication_data_type' = 'fp8' .*unknown dtype name 'fp8'"):
        load_config({"train_batch_size": 1, "communication_data_type": "fp8"}, 1)
    with pytest.raises(ConfigError, match="'data_types.param_dtype' = 'int4'"):
        load_config({"train_batch_size": 1, "data_types": {"param_dtype": "int4"}}, 1)


def test_enumerated_values() -> None:
    assert load_config({"train_batch_size": 1, "gradient_allreduce_op": "SUM"}, 1).gradient_allreduce_op == "sum"
    with pytest.raises(ConfigError, match="gradient_allreduce_op' = 'max'"):
        load_config({"train_batch_size": 1, "gradient_allreduce_op": "max"}, 1)
    for given, stored in (("warn", "Warn"), ("IGNORE", "Ignore"), ("Fail", "Fail")):
        cfg = load_config({"train_batch_size": 1, "checkpoint": {"tag_validation": given}}, 1)
        assert cfg.checkpoint.tag_validation == stored
    with pytest.raises(ConfigError, match="checkpoint.tag_validation' = 'strict'"):
        load_config({"train_batch_size": 1, "checkpoint": {"tag_validation": "strict"}}, 1)
    with pytest.raises(ConfigError, match="pipeline.stages' = 0"):
        load_config({"train_batch_size": 1, "pipeline": {"stages": 0}}, 1)


def test_numeric_bounds() -> None:
    with pytest.raises(ConfigError, match="gradient_clipping' = -1.0"):
        load_config({"train_batch_size": 1, "gradient_clipping": -1.0}, 1)
    with pytest.raises(ConfigError, match="gradient_predivide_factor' = 0"):
        load_config({"train_batch_size": 1, "gradient_predivide_factor": 0}, 1)
    with pytest.raises(ConfigError, match="fp16.loss_scale' = -2"):
        load_config({"train_batch_size": 1, "fp16": {"loss_scale": -2}}, 1)


def test_amp_allows_apex_options_only_there() -> None:
    cfg = load_config({"train_batch_size": 1, "amp": {"enabled": False, "opt_level": "O2"}}, 1)
    assert not cfg.amp.enabled and cfg.amp.params == {"opt_level": "O2"}  # switched on, it is refused
    with pytest.raises(ConfigError, match="unknown config key 'bf16.opt_level'"):
        load_config({"train_batch_size": 1, "bf16": {"opt_level": "O2"}}, 1)


def test_steps_per_print_infinity_means_never() -> None:
    assert load_config({"train_batch_size": 1, "steps_per_print": float("inf")}, 1).steps_per_print is None
    assert load_config({"train_batch_size": 1, "steps_per_print": 10}, 1).steps_per_print == 10


def test_unimplemented_sections_warn_only_when_enabled(warnings_logged: list[str]) -> None:
    cfg = load_config({"train_batch_size": 1, "autotuning": {"enabled": True, "fast": True},
                       "elasticity": {"enabled": False}, "sequence_parallel_size": 2, "disable_allgather": True,
                       "hybrid_engine": {"enabled": False}, "tensor_parallel": {"autotp_size": 2},
                       "compile": {"deepcompile": False}, "log_level": "info"}, 1)
    assert cfg.autotuning == {"enabled": True, "fast": True} and cfg.sequence_parallel_size == 2
    # tensor_parallel: deepshard.tp; sequence_parallel_size: deepshard.sp; autotuning: the launcher's
    expected = {"disable_allgather"}
    assert {m.split(" ")[0] for m in warnings_logged} == expected
    assert all(m.endswith("is not implemented by deepshard and is ignored") for m in warnings_logged)
    assert len(warnings_logged) == len(expected)


def test_sequence_parallel_keys() -> None:
    cfg = load_config({"train_batch_size": 1, "sequence_parallel_size": 4,
                       "sequence_parallel": {"mode": "hybrid", "ulysses_size": 2}}, 1)
    assert cfg.sequence_parallel_size == 4 and cfg.sequence_parallel.mode == "hybrid"
    assert load_config({"train_batch_size": 1}, 1).sequence_parallel.mode == "ulysses"
    with pytest.raises(ConfigError, match="needs sequence_parallel.ulysses_size, a divisor"):
        load_config({"train_batch_size": 1, "sequence_parallel_size": 4, "sequence_parallel": {"mode": "hybrid"}}, 1)
    with pytest.raises(ConfigError, match="only applies to mode \"hybrid\""):
        load_config({"train_batch_size": 1, "sequence_parallel_size": 4,
                     "sequence_parallel": {"mode": "ring", "ulysses_size": 2}}, 1)
    with pytest.raises(ConfigError, match="sequence_parallel_size must be an integer >= 1"):
        load_config({"train_batch_size": 1, "sequence_parallel_size": 0}, 1)


def test_unimplemented_zero_features_warn(warnings_logged: list[str]) -> None:
    load_config({"train_batch_size": 1, "zero_optimization": {"stage": 3, "legacy_stage1": True,
                                                              "zero_hpz_partition_size": 1}}, 1)
    assert warnings_logged == ["zero_optimization.legacy_stage1 is not implemented by deepshard "
                               "and is ignored"]


def test_zeropp_and_mics_keys_are_read_not_ignored(warnings_logged: list[str]) -> None:
    """ZeRO++ and MiCS have their behaviour (deepshard.zero.hierarchy): no 'ignored' warning; LoCo is refused."""
    cfg = load_config({"train_batch_size": 1, "zero_optimization": {
        "stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": 2,
        "zero_quantized_nontrainable_weights": True, "mics_shard_size": 2, "mics_hierarchical_params_gather": True}}, 1)
    zero = cfg.zero_optimization
    assert (zero.zero_quantized_weights, zero.zero_quantized_gradients, zero.zero_hpz_partition_size,
            zero.mics_shard_size, zero.mics_hierarchical_params_gather) == (True, True, 2, 2, True)
    assert warnings_logged == []
    with pytest.raises(ConfigError, match="zeropp_loco_param .* is not implemented: DeepSpeed 0.19.8 removed it"):
        load_config({"train_batch_size": 1, "zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                                                                  "zeropp_loco_param": {"err_beta": 0.8}}}, 1)


def test_every_unimplemented_key_is_a_root_field() -> None:
    assert set(UNIMPLEMENTED_KEYS) <= set(DeepShardConfig.model_fields)


def test_optimizer_section_rules() -> None:
    cfg = load_config({"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {}, "legacy_fusion": False}}, 1)
    assert cfg.optimizer.type == "Adam" and cfg.optimizer.legacy_fusion is False
    with pytest.raises(ConfigError, match="config key 'optimizer.type' is required but missing"):
        load_config({"train_batch_size": 1, "optimizer": {"params": {"lr": 0.1}}}, 1)
    with pytest.raises(ConfigError, match="unknown config key 'scheduler.param'; did you mean 'params'"):
        load_config({"train_batch_size": 1, "scheduler": {"type": "WarmupLR", "param": {}}}, 1)


@pytest.mark.parametrize("enabled", [True, False])
def test_expert_parallel_load_balance_coeff_only_null(enabled: bool) -> None:
    """DeepSpeed's rule: ``load_balance_coeff`` (its expert-bias balancing, not implemented) may only be null or
    left out, whether or not the section is enabled; the refusal names the value and the fix."""
    from deepshard.runtime.ds_config import DeepSpeedConfig

    base = {"train_micro_batch_size_per_gpu": 1}
    for section in ({"enabled": enabled, "autoep_size": 1}, {"enabled": enabled, "load_balance_coeff": None}):
        cfg = DeepSpeedConfig({**base, "expert_parallel": section})
        assert cfg.expert_parallel_config.load_balance_coeff is None
        assert cfg.expert_parallel_config.enabled is enabled
    for value in (0, 0.0, 1e-3, False, True, "1e-3", [1e-3], {"coeff": 1e-3}):
        with pytest.raises(ValueError) as info:
            DeepSpeedConfig({**base, "expert_parallel": {"enabled": enabled, "load_balance_coeff": value}})
        text = str(info.value)
        assert repr(value) in text and "not supported" in text and "null" in text and "omit" in text, text
