"""DeepSpeed's config accessor methods on the engine (``engine.steps_per_print()``, ``engine.zero_offload_param()``).

DeepSpeed's engine answers about a hundred small questions about its config with methods; clients call them
(``engine.gradient_clipping()``, ``engine.zero_optimization_partition_weights()``). :class:`EngineAccessors`
answers the same questions from deepshard's validated config (``deepshard.config.root.DeepShardConfig``):

- :data:`CONFIG_READS`: methods that return one config value, as ``name -> (dotted path, type)``;
- :data:`DISABLED_FEATURES`: methods about features deepshard does not implement and whose config sections it
  refuses to turn on (random-LTD, curriculum learning, data efficiency, DeepCompile passes, ZenFlow): they
  return what DeepSpeed returns while the feature is off;
- the methods below, whose answer is derived (offload devices, ZeRO stage tests, dtypes, batch info).

Where DeepSpeed returns a config object, the engine returns deepshard's section object for the same section
(``zero_offload_param()`` is a ``deepshard.config.zero.OffloadParamConfig`` with DeepSpeed's field names).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from deepshard.autotuning.settings import AutotuningSettings
from deepshard.config.base import dtype_from_name
from deepshard.tp.autotp_config import AutoTPConfig, parse_tp_config

# name -> (path in DeepShardConfig, return type): the method returns that config value unchanged
CONFIG_READS: dict[str, tuple[str, Any]] = {
    "train_batch_size": ("train_batch_size", int),
    "train_micro_batch_size_per_gpu": ("train_micro_batch_size_per_gpu", int),
    "gradient_accumulation_steps": ("gradient_accumulation_steps", int),
    "managed_gradient_accumulation": ("managed_gradient_accumulation", bool),
    "gradient_clipping": ("gradient_clipping", float),
    "gradient_predivide_factor": ("gradient_predivide_factor", float),
    "steps_per_print": ("steps_per_print", Optional[int]),
    "wall_clock_breakdown": ("wall_clock_breakdown", bool),
    "memory_breakdown": ("memory_breakdown", bool),
    "dump_state": ("dump_state", bool),
    "dataloader_drop_last": ("dataloader_drop_last", bool),
    "zero_allow_untested_optimizer": ("zero_allow_untested_optimizer", bool),
    "zero_force_ds_cpu_optimizer": ("zero_force_ds_cpu_optimizer", bool),
    "fp16_enabled": ("fp16.enabled", bool),
    "fp16_auto_cast": ("fp16.auto_cast", bool),
    "fp16_master_weights_and_gradients": ("fp16.fp16_master_weights_and_grads", bool),
    "bfloat16_enabled": ("bf16.enabled", bool),
    "bf16_master_weights_and_gradients": ("bf16.bf16_master_weights_and_grads", bool),
    "bf16_optimizer_states": ("bf16.bf16_optimizer_states", bool),
    "torch_autocast_enabled": ("torch_autocast.enabled", bool),
    "flops_profiler_module_depth": ("flops_profiler.module_depth", int),
    "flops_profiler_top_modules": ("flops_profiler.top_modules", int),
    "flops_profiler_output_file": ("flops_profiler.output_file", Optional[str]),
    "flops_profiler_recompute_fwd_factor": ("flops_profiler.recompute_fwd_factor", float),
    "checkpoint_serialization_enabled": ("checkpoint.serialization", bool),
    "load_universal_checkpoint": ("checkpoint.load_universal", bool),
    "use_node_local_storage": ("checkpoint.use_node_local_storage", bool),
    "zero_optimization_stage": ("zero_optimization.stage", int),
    "zero_contiguous_gradients": ("zero_optimization.contiguous_gradients", bool),
    "zero_reduce_scatter": ("zero_optimization.reduce_scatter", bool),
    "zero_overlap_comm": ("zero_optimization.overlap_comm", bool),
    "zero_reduce_bucket_size": ("zero_optimization.reduce_bucket_size", int),
    "zero_allgather_partitions": ("zero_optimization.allgather_partitions", bool),
    "zero_allgather_bucket_size": ("zero_optimization.allgather_bucket_size", int),
    "zero_multi_rank_bucket_allreduce": ("zero_optimization.use_multi_rank_bucket_allreduce", bool),
    "zero_load_from_fp32_weights": ("zero_optimization.load_from_fp32_weights", bool),
    "zero_elastic_checkpoint": ("zero_optimization.elastic_checkpoint", bool),
    "zero_sub_group_size": ("zero_optimization.sub_group_size", int),
    "zero_round_robin_gradients": ("zero_optimization.round_robin_gradients", bool),
    "zero_ignore_unused_parameters": ("zero_optimization.ignore_unused_parameters", bool),
    "zero_prefetch_bucket_size": ("zero_optimization.prefetch_bucket_size", Optional[int]),
    "zero_param_persistence_threshold": ("zero_optimization.param_persistence_threshold", int),
    "zero_model_persistence_threshold": ("zero_optimization.model_persistence_threshold", int),
    "zero_max_live_parameters": ("zero_optimization.max_live_parameters", int),
    "zero_max_reuse_distance": ("zero_optimization.max_reuse_distance", int),
    "zero_gather_16bit_weights_on_model_save": ("zero_optimization.gather_16bit_weights_on_model_save", bool),
    "zero_module_granularity_threshold": ("zero_optimization.module_granularity_threshold", int),
    "zero_allgather_sequential": ("zero_optimization.allgather_sequential", bool),
    "zero_log_trace_cache_warnings": ("zero_optimization.log_trace_cache_warnings", bool),
    "is_sanity_checks_enabled": ("zero_optimization.enable_sanity_checks", bool),
    "zero_save_muon_momentum_buffer_in_memory": ("zero_optimization.save_muon_momentum_buffer_in_memory", bool),
    "zero_hpz_partition_size": ("zero_optimization.zero_hpz_partition_size", int),
    "zero_quantized_weights": ("zero_optimization.zero_quantized_weights", bool),
    "zero_quantized_nontrainable_weights": ("zero_optimization.zero_quantized_nontrainable_weights", bool),
    "zero_quantized_gradients": ("zero_optimization.zero_quantized_gradients", bool),
    "zero_offload_optimizer": ("zero_optimization.offload_optimizer", "Optional[OffloadOptimizerConfig]"),
    "zero_offload_param": ("zero_optimization.offload_param", "Optional[OffloadParamConfig]"),
}

# features deepshard does not implement (their config sections are refused when turned on): DeepSpeed's answer
# while the feature is off
DISABLED_FEATURES: dict[str, Any] = {
    "random_ltd_enabled": False,
    "curriculum_learning_enabled": False,
    "data_efficiency_enabled": False,
    "data_sampling_enabled": False,
    "is_deepcompile_enabled": False,
    "is_deepcompile_active": False,
    "uses_parallelization_pass_only": False,
    "compile_zero_optimization_stage": False,
    "compile_autosp": False,
    "compile_autotp": False,
    "zenflow_config": None,
    "zero_legacy_stage1": False,
    "zero_parameter_alignment": False,
    "zero_nvme_offload_optimizer": False,
    "optimizer_legacy_fusion": False,
}


def _read(config: Any, path: str) -> Any:
    value = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _reader(name: str, path: str, returns: Any) -> Callable[[Any], Any]:
    def accessor(self: Any) -> Any:
        return _read(self._config, path)

    accessor.__name__ = accessor.__qualname__ = name
    accessor.__doc__ = f"DeepSpeed's ``engine.{name}()``: the config's ``{path}``."
    accessor.__annotations__ = {"return": returns}
    return accessor


def _disabled(name: str, value: Any) -> Callable[[Any], Any]:
    def accessor(self: Any) -> Any:
        return value

    accessor.__name__ = accessor.__qualname__ = name
    accessor.__doc__ = (f"DeepSpeed's ``engine.{name}()``: always {value!r}, its value while the feature is off "
                        "(deepshard does not implement the feature and refuses the config that turns it on).")
    accessor.__annotations__ = {"return": type(value) if value is not None else type(None)}
    return accessor


class EngineAccessors:
    """DeepSpeed's config accessor methods; the engine sets ``self._config`` (a ``DeepShardConfig``)."""

    _config: Any
    topology: Any

    # ------------------------------------------------------------------ optimizer / scheduler
    def optimizer_name(self) -> Optional[str]:
        """The config's ``optimizer.type`` lowercased, else the class name of the optimizer the client passed
        (as DeepSpeed); None without either."""
        section = self._config.optimizer
        if section is not None:
            return section.type.lower()
        client = getattr(self, "optimizer", None)
        return type(client).__name__ if client is not None else None

    def optimizer_params(self) -> Optional[dict[str, Any]]:
        section = self._config.optimizer
        return dict(section.params) if section is not None else None

    def scheduler_name(self) -> Optional[str]:
        section = self._config.scheduler
        return section.type if section is not None else None

    def scheduler_params(self) -> Optional[dict[str, Any]]:
        section = self._config.scheduler
        return dict(section.params) if section is not None else None

    # ------------------------------------------------------------------ precision
    def dynamic_loss_scale(self) -> bool:
        return self._config.fp16.loss_scale == 0

    def initial_dynamic_scale(self) -> int:
        return int(2 ** self._config.fp16.initial_scale_power)

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """The dynamic loss scaler's settings under DeepSpeed's names."""
        fp16 = self._config.fp16
        return {"init_scale": self.initial_dynamic_scale(), "scale_window": fp16.loss_scale_window,
                "delayed_shift": fp16.hysteresis, "consecutive_hysteresis": fp16.consecutive_hysteresis,
                "min_scale": _whole(fp16.min_loss_scale)}

    def torch_autocast_dtype(self) -> Optional[torch.dtype]:
        name = self._config.torch_autocast.dtype
        return _dtype(name) if name is not None else None

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(model dtype, gradient accumulation dtype)."""
        model = self._config.model_dtype
        accum = self._config.data_types.grad_accum_dtype
        return model, (_dtype(accum) if accum is not None else model)

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: the config's ``communication_data_type``, else the model dtype."""
        name = self._config.communication_data_type
        return _dtype(name) if name is not None else self._config.model_dtype

    def postscale_gradients(self) -> bool:
        return not self._config.prescale_gradients

    # ------------------------------------------------------------------ ZeRO
    def zero_optimization(self) -> bool:
        return self._config.zero_enabled

    def zero_optimization_partition_gradients(self) -> bool:
        return self._config.zero_stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self._config.zero_stage >= 3

    def is_first_weights_partition_group(self) -> bool:
        return self.zero_optimization_partition_weights()

    def zero_cpu_offload(self) -> bool:
        return self._config.zero_optimization.offload_optimizer_device == "cpu"

    def zero_use_cpu_optimizer(self) -> bool:
        return self._config.zero_optimization.offload_optimizer_device in ("cpu", "nvme")

    def zero_partial_offload(self) -> float:
        offload = self._config.zero_optimization.offload_optimizer
        return float(offload.ratio) if offload is not None else 1.0

    def super_offload(self) -> bool:
        offload = self._config.zero_optimization.offload_optimizer
        return bool(offload.super_offload) if offload is not None else False

    def cpuadam_cores_perc(self) -> float:
        """The offload section's value; 0.9 (DeepSpeed's fallback) without an ``offload_optimizer`` section."""
        offload = self._config.zero_optimization.offload_optimizer
        return float(offload.cpuadam_cores_perc) if offload is not None else 0.9

    def zero_compute_grad_norm(self) -> bool:
        return True

    # ------------------------------------------------------------------ checkpoints, profiler, tuning
    def checkpoint_tag_validation_enabled(self) -> bool:
        return self._config.checkpoint.tag_validation != "Ignore"

    def checkpoint_tag_validation_fail(self) -> bool:
        return self._config.checkpoint.tag_validation == "Fail"

    def checkpoint_writer_enabled(self) -> bool:
        return self._config.checkpoint.writer is not None

    def aio_config(self) -> dict[str, Any]:
        """The ``aio`` section as a dict (as DeepSpeed)."""
        return self._config.aio.model_dump()

    def autotuning_enabled(self) -> bool:
        section = self._config.autotuning
        return bool(isinstance(section, dict) and section.get("enabled", False))

    def _autotuning(self) -> AutotuningSettings:
        return AutotuningSettings.from_config({"autotuning": self._config.autotuning or {}})

    def autotuning_start_profile_step(self) -> int:
        return self._autotuning().start_profile_step

    def autotuning_end_profile_step(self) -> int:
        return self._autotuning().end_profile_step

    def autotuning_metric(self) -> str:
        return self._autotuning().metric

    def autotuning_profile_model_info(self) -> bool:
        info = (self._config.autotuning or {}).get("model_info") or {}
        return bool(self.autotuning_enabled() and info.get("profile", False))

    def flops_profiler_enabled(self) -> bool:
        return bool(self._config.flops_profiler.enabled or self.autotuning_enabled())

    def flops_profiler_profile_step(self) -> int:
        if self.autotuning_enabled():
            return self.autotuning_start_profile_step()
        return self._config.flops_profiler.profile_step

    def flops_profiler_detailed(self) -> bool:
        return False if self.autotuning_enabled() else bool(self._config.flops_profiler.detailed)

    # ------------------------------------------------------------------ parallelism, batch, logging
    def tensor_parallel_config(self) -> AutoTPConfig:
        """deepshard's parsed ``tensor_parallel`` section (``deepshard.tp.autotp_config.AutoTPConfig``)."""
        return parse_tp_config(self._config.tensor_parallel)

    def autotp_size(self) -> int:
        """The config's ``tensor_parallel.autotp_size`` (0 when not given, as DeepSpeed)."""
        section = self._config.tensor_parallel or {}
        return int(section.get("autotp_size") or 0)

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        cfg = self._config
        return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps

    def get_data_parallel_rank(self) -> int:
        return int(self.topology.dp.rank)

    def get_model_parallel_rank(self) -> int:
        return int(self.topology.model_parallel.rank)

    def get_tensor_parallel_rank(self) -> int:
        return int(self.topology.tp.rank)

    def data_efficiency_config(self) -> dict[str, Any]:
        """DeepSpeed's data-efficiency section as it reads while off (deepshard does not implement it)."""
        return {"enabled": False, "data_sampling": self.data_sampling_config(),
                "data_routing": {"enabled": False, "random_ltd": self.random_ltd_config()}}

    def data_sampling_config(self) -> dict[str, Any]:
        return {"enabled": False, "curriculum_learning": self.curriculum_learning_config()}

    def log_level(self) -> Optional[str]:
        level = self._config.log_level
        return level if isinstance(level, str) else None

    def random_ltd_config(self) -> dict[str, Any]:
        return {"enabled": False, "layer_token_lr_schedule": {"enabled": False}}

    def curriculum_learning_config(self) -> dict[str, Any]:
        return {"enabled": False}


def _whole(value: float) -> float | int:
    """``value`` as an int when it is a whole number (DeepSpeed's ``min_loss_scale`` is an int)."""
    return int(value) if float(value).is_integer() else value


def _dtype(name: str) -> torch.dtype:
    return dtype_from_name(name)


for _name, (_path, _returns) in CONFIG_READS.items():
    setattr(EngineAccessors, _name, _reader(_name, _path, _returns))
for _name, _value in DISABLED_FEATURES.items():
    setattr(EngineAccessors, _name, _disabled(_name, _value))
