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


# Hyperparameters torch's optimizers (and deepshard's Lamb / Lion) take as plain numbers, with the
# smallest value that makes sense. Checked here so a bad value names its key instead of failing deep
# inside the optimizer's constructor ("'<=' not supported between instances of 'float' and 'str'").
NON_NEGATIVE_PARAMS = ("lr", "eps", "weight_decay", "momentum", "dampening", "alpha", "lr_decay",
                       "initial_accumulator_value", "max_coeff", "min_coeff", "rho")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_number(path: str, value: Any) -> None:
    if not _is_number(value):
        hint = f" (write {value} without quotes)" if isinstance(value, str) and _parses(value) else ""
        raise exact_error(f"{path} = {value!r} ({type(value).__name__}) is invalid: expected a number{hint}")
    if not value >= 0 or value == float("inf"):
        raise exact_error(f"{path} = {value!r} is invalid: expected a finite number >= 0")


def _parses(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_hyperparameters(params: dict[str, Any], section_path: str) -> None:
    """Raise naming ``<section>.params.<key>`` for a non-numeric or negative learning rate, epsilon,
    weight decay... and for ``betas`` that are not two numbers in [0, 1)."""
    for key in NON_NEGATIVE_PARAMS:
        if key in params:
            _check_number(f"{section_path}.params.{key}", params[key])
    if "betas" in params:
        betas = params["betas"]
        ok = (isinstance(betas, (list, tuple)) and len(betas) == 2
              and all(_is_number(b) and 0.0 <= b < 1.0 for b in betas))
        if not ok:
            raise exact_error(f"{section_path}.params.betas = {betas!r} is invalid: expected two numbers in "
                              "[0, 1), e.g. [0.9, 0.999]")


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
    def _check_hyperparameters(cls, params: dict[str, Any]) -> dict[str, Any]:
        check_hyperparameters(params, cls.section_path)
        return params

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
