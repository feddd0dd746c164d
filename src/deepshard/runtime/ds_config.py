"""``deepspeed.runtime.config.DeepSpeedConfig``: deepshard's validated config (:class:`DeepShardConfig`)
built the way DeepSpeed builds its config object, and read by DeepSpeed's attribute names.

``DeepSpeedConfig(config, mpu=None, mesh_device=None)`` takes a dict, a JSON path or base64 JSON; the
data-parallel size for the batch arithmetic comes, as in DeepSpeed, from ``mpu``, else the mesh's data
dimension, else the initialized world divided by ``sequence_parallel_size``, else 1. The batch keys can be
reassigned and re-derived with ``_configure_train_batch_size()`` (what DeepSpeed's batch tests do).
"""
from __future__ import annotations

from typing import Any

from pydantic import PrivateAttr, ValidationError

from deepshard.config.base import ConfigError
from deepshard.config.batch import resolve_batch_sizes
from deepshard.config.errors import config_error_from
from deepshard.config.loader import ConfigSource, read_config_source
from deepshard.config.root import DeepShardConfig

__all__ = ["BatchSizeError", "DeepSpeedConfig"]


class BatchSizeError(ConfigError, AssertionError):
    """The batch keys do not satisfy ``train_batch_size == micro * accumulation * data-parallel size``.
    (An AssertionError too: DeepSpeed's batch check is an assertion, and code written for it catches that.)"""


def data_parallel_size(raw: dict[str, Any], mpu: Any = None, mesh_device: Any = None) -> int:
    """The data-parallel size DeepSpeed's config uses for its batch arithmetic."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    if mpu is not None:
        if hasattr(mpu, "get_sequence_parallel_world_size"):
            return max(1, dist.get_world_size() // mpu.get_sequence_parallel_world_size())
        return int(mpu.get_data_parallel_world_size())
    if mesh_device is not None:
        return int(dist.get_world_size(mesh_device.get_group(mesh_dim="data_parallel")))
    sp = raw.get("sequence_parallel_size", 1)
    return max(1, dist.get_world_size() // (sp if isinstance(sp, int) and sp > 0 else 1))


class DeepSpeedConfig(DeepShardConfig):
    """deepshard's config object under DeepSpeed's constructor and attribute names (module docstring)."""

    _world_size: int = PrivateAttr(default=1)

    def __init__(self, config: ConfigSource, mpu: Any = None, mesh_device: Any = None) -> None:
        data, origin = read_config_source(config)
        dp = data_parallel_size(data, mpu, mesh_device)
        try:
            type(self).__pydantic_validator__.validate_python(data, self_instance=self,
                                                              context={"dp_world_size": dp})
        except ValidationError as exc:
            raise config_error_from(exc, DeepShardConfig, origin) from None
        self._world_size = dp

    def _configure_train_batch_size(self) -> None:
        """Re-derive the batch keys from the ones set now (None = not given), as DeepSpeed does after
        its batch attributes are assigned; :class:`BatchSizeError` when they disagree."""
        try:
            self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = (
                resolve_batch_sizes(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                    self.gradient_accumulation_steps, self._world_size))
        except ConfigError as exc:
            raise BatchSizeError(str(exc)) from None

    # DeepSpeed's flat attribute names -------------------------------------------------------------
    @property
    def _param_dict(self) -> dict[str, Any]:
        """The config as given (DeepSpeed's name for it)."""
        return self.raw

    @property
    def world_size(self) -> int:
        """The data-parallel size the batch keys were derived with."""
        return self._world_size

    @property
    def zero_config(self) -> Any:
        return self.zero_optimization

    @property
    def zero_optimization_stage(self) -> int:
        return self.zero_stage

    @property
    def float16_config(self) -> Any:
        return self.fp16

    @property
    def bfloat16_config(self) -> Any:
        return self.bf16

    @property
    def bfloat16_enabled(self) -> bool:
        return self.bf16.enabled

    @property
    def fp16_auto_cast(self) -> bool:
        return self.fp16.auto_cast

    @property
    def fp16_master_weights_and_gradients(self) -> bool:
        return self.fp16.fp16_master_weights_and_grads

    @property
    def loss_scale(self) -> float:
        return self.fp16.loss_scale

    @property
    def initial_dynamic_scale(self) -> int:
        return 2 ** self.fp16.initial_scale_power

    @property
    def activation_checkpointing_config(self) -> Any:
        return self.activation_checkpointing

    @property
    def flops_profiler_config(self) -> Any:
        return self.flops_profiler

    @property
    def eigenvalue_enabled(self) -> bool:
        return bool((self.eigenvalue or {}).get("enabled", False))

    @property
    def eigenvalue_verbose(self) -> bool:
        return bool((self.eigenvalue or {}).get("verbose", False))

    @property
    def optimizer_name(self) -> str | None:
        return self.optimizer.type.lower() if self.optimizer is not None else None

    @property
    def optimizer_params(self) -> dict[str, Any] | None:
        return dict(self.optimizer.params) if self.optimizer is not None else None

    @property
    def scheduler_name(self) -> str | None:
        return self.scheduler.type if self.scheduler is not None else None

    @property
    def scheduler_params(self) -> dict[str, Any] | None:
        return dict(self.scheduler.params) if self.scheduler is not None else None

    @property
    def expert_parallel_config(self) -> Any:
        """The ``expert_parallel`` section (AutoEP) as read: :class:`deepshard.moe.autoep_config.AutoEPConfig`
        (``enabled``, ``autoep_size``, ``preset_model``, ``load_balance_coeff``; ``raw`` the section as given)."""
        from deepshard.moe.autoep_config import AutoEPConfig

        return AutoEPConfig(self.expert_parallel)
