"""DeepSpeed's config accessor methods on the engine (``engine.steps_per_print()``, ``engine.zero_offload_param()``).

DeepSpeed's engine answers about a hundred small questions about its config with methods; clients call them
(``engine.gradient_clipping()``, ``engine.zero_optimization_partition_weights()``). :class:`EngineAccessors`
answers the same questions from deepshard's validated config (``deepshard.config.root.DeepShardConfig``):

- methods that return one config value, and methods about features deepshard does not implement and whose
  config sections it refuses to turn on (random-LTD, curriculum learning, data efficiency, DeepCompile passes,
  ZenFlow), which return what DeepSpeed returns while the feature is off: generated
  from the tables of ``deepshard.engine_accessor_specs`` into ``engine_accessors_generated.py``
  (``GeneratedAccessors``, this class's base) by ``tools/gen_engine_accessors.py``;
- the methods below, whose answer is derived (offload devices, ZeRO stage tests, dtypes, batch info).

Where DeepSpeed returns a config object, the engine returns deepshard's section object for the same section
(``zero_offload_param()`` is a ``deepshard.config.zero.OffloadParamConfig`` with DeepSpeed's field names).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from deepshard.autotuning.settings import AutotuningSettings
from deepshard.config.base import dtype_from_name
from deepshard.engine_accessors_generated import GeneratedAccessors
from deepshard.topology import Topology
from deepshard.tp.autotp_config import AutoTPConfig, parse_tp_config


class EngineAccessors(GeneratedAccessors):
    """DeepSpeed's config accessor methods: the generated ones (one config value, or a disabled feature's
    answer) and those below, whose answer is derived. The engine sets ``self._config``."""

    topology: Topology

    # ------------------------------------------------------------------ optimizer / scheduler
    def optimizer_name(self) -> Optional[str]:
        """The config's ``optimizer.type`` lowercased, else the class name of the optimizer the client passed
        (as DeepSpeed); None without either."""
        section = self._config.optimizer
        if section is not None:
            return section.type.lower()
        client = getattr(self, "basic_optimizer", None)
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

    def checkpoint_tag_validation_mode(self) -> str:
        """``checkpoint.tag_validation``: what ``save_checkpoint`` does when ranks pass different tags
        ("Warn", "Ignore" or "Fail"; ``checkpoint.collective.agree_on_tag``)."""
        return self._config.checkpoint.tag_validation

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
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

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
