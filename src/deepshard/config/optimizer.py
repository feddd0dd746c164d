"""The ``optimizer`` and ``scheduler`` sections: a type name and free-form constructor params.

The params are passed on to the optimizer / LR scheduler the engine builds, so they are not
checked here beyond one rule: a value of ``"auto"`` is an error, because only the Hugging Face
Trainer/Accelerate know what to put there (they fill it before calling DeepSpeed).
"""
from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator

from deepshard.config.base import AUTO, HF_AUTO_HINT, Section, exact_error
from deepshard.utils.logging import logger


def _is_auto(value: Any) -> bool:
    if isinstance(value, str):
        return value == AUTO
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, str) and v == AUTO for v in value)
    return False


def reject_auto_params(params: dict[str, Any], section_path: str) -> None:
    """Raise naming every ``<section>.params.<key>`` whose value is (or contains) ``"auto"``."""
    keys = [f"{section_path}.params.{key}" for key, value in params.items() if _is_auto(value)]
    if keys:
        verb = "is" if len(keys) == 1 else "are"
        raise exact_error(f"{', '.join(keys)} {verb} 'auto': {HF_AUTO_HINT}")


class _TypedParams(Section):
    type: str = Field(min_length=1)
    """The class name (``"AdamW"``, ``"WarmupLR"``...); see the engine for the names it knows."""

    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the class."""

    @field_validator("params")
    @classmethod
    def _no_auto_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        reject_auto_params(params, cls.section_path)
        return params


class OptimizerConfig(_TypedParams):
    """``optimizer: {type, params, legacy_fusion}``. Names are matched case-insensitively later."""

    section_path: ClassVar[str] = "optimizer"

    legacy_fusion: bool = False
    """Accepted for DeepSpeed compatibility (it selected an old fused fp16 optimizer); no effect."""

    @field_validator("params")
    @classmethod
    def _warn_max_grad_norm(cls, params: dict[str, Any]) -> dict[str, Any]:
        value = params.get("max_grad_norm")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            logger.warning(
                "optimizer.params.max_grad_norm (%s) is not how clipping is configured; use the "
                "top-level 'gradient_clipping' key instead", value)
        return params


class SchedulerConfig(_TypedParams):
    """``scheduler: {type, params}`` (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest,
    or a ``torch.optim.lr_scheduler`` class name)."""

    section_path: ClassVar[str] = "scheduler"
