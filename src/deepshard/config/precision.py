"""Mixed-precision sections: ``fp16``, ``bf16`` (alias ``bfloat16``), ``amp``, ``torch_autocast``,
``data_types``. Defaults follow DeepSpeed v0.19.x (``runtime/precision_config.py``)."""
from __future__ import annotations

from typing import Any, ClassVar, Optional

from pydantic import ConfigDict, Field, field_validator, model_validator

from deepshard.config.base import DtypeName, Section, exact_error


class FP16Config(Section):
    """fp16 training with (by default) dynamic loss scaling (Micikevicius et al., 2018).

    ``loss_scale_window`` and ``min_loss_scale`` are checked (positive) only where they are used, i.e. when
    fp16 is enabled with dynamic scaling (``loss_scale`` 0), as DeepSpeed does: a static-scale config may
    carry unused values."""

    section_path: ClassVar[str] = "fp16"

    enabled: bool = False
    auto_cast: bool = False
    """Cast the model's floating-point inputs to fp16 in forward."""
    loss_scale: float = Field(0.0, ge=0, allow_inf_nan=False)
    """A fixed loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: int = Field(16, ge=0)
    """Dynamic scaling starts at ``2 ** initial_scale_power``."""
    loss_scale_window: int = 1000
    """Steps without overflow before the scale is doubled."""
    hysteresis: int = Field(2, ge=1)
    """Overflows tolerated before the scale is halved."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every step without overflow."""
    min_loss_scale: float = Field(1.0, allow_inf_nan=False)
    fp16_master_weights_and_grads: bool = False

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _loss_scale_is_a_number(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError("fp16.loss_scale must be a number (0 for dynamic loss scaling)")
        return value  # a number written as a string was converted (base.convert_number_strings); others are refused

    @model_validator(mode="after")
    def _dynamic_scaling_settings(self) -> "FP16Config":
        if self.enabled and self.loss_scale == 0:
            for key in ("loss_scale_window", "min_loss_scale"):
                if getattr(self, key) <= 0:
                    raise exact_error(f"fp16.{key} must be > 0 with dynamic loss scaling (fp16 enabled, "
                                      f"loss_scale 0), got {getattr(self, key)!r}")
        return self

    def initial_dynamic_scale(self) -> float:
        """The first loss scale of dynamic scaling, ``2 ** initial_scale_power``."""
        return float(2 ** self.initial_scale_power)


class BF16Config(Section):
    """bf16 training with fp32 master weights (no loss scaling needed)."""

    section_path: ClassVar[str] = "bf16"

    enabled: bool = False
    immediate_grad_update: bool = False
    check_grad_overflow: bool = True
    """Check gradients for inf/NaN and skip the step (default true since DeepSpeed v0.19.3)."""
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False


class AMPConfig(Section):
    """``amp``: NVIDIA Apex AMP. Every key besides ``enabled`` is an ``amp.initialize`` option and is
    kept as given (the only section that allows keys deepshard does not know)."""

    model_config = ConfigDict(extra="allow")
    section_path: ClassVar[str] = "amp"

    enabled: bool = False

    @property
    def params(self) -> dict[str, Any]:
        """The Apex options (everything but ``enabled``)."""
        return dict(self.model_extra or {})


class TorchAutocastConfig(Section):
    """``torch_autocast``: run forward under ``torch.autocast`` instead of casting the model."""

    section_path: ClassVar[str] = "torch_autocast"

    enabled: bool = False
    dtype: Optional[DtypeName] = None
    lower_precision_safe_modules: Optional[list[str]] = None
    """Module classes (``"torch.nn.Linear"``) whose layers may run in the lower precision."""


class DataTypesConfig(Section):
    """``data_types``: dtypes of gradient accumulation, parameters and buffers (None = derived)."""

    section_path: ClassVar[str] = "data_types"

    grad_accum_dtype: Optional[DtypeName] = None
    param_dtype: Optional[DtypeName] = None
    buffer_dtype: Optional[DtypeName] = None
