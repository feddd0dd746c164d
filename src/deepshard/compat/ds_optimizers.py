"""DeepSpeed's optimizer wrapper classes by name (``deepspeed.runtime.base_optimizer``, ``.bf16_optimizer``,
``.fp16.fused_optimizer``, ``.fp16.unfused_optimizer``, ``.zero.stage_1_and_2``, ``.zero.stage3``).

DeepSpeed wraps the user's optimizer in one of these (``engine.optimizer`` is a ``DeepSpeedZeroOptimizer``
at ZeRO 1/2, a ``BF16_Optimizer`` for bf16 at ZeRO 0 ...). deepshard does not wrap it: ``engine.optimizer`` is
the torch optimizer itself, and the engine does the partitioning, mixed precision and loss scaling. So no
deepshard object is an instance of these classes, which is what code that asks ``isinstance(engine.optimizer,
DeepSpeedZeroOptimizer)`` learns (DeepSpeed's own checkpoint tests then compare the torch optimizer's
state), and constructing one is refused, saying where the functionality is.
"""
from __future__ import annotations

from typing import Any

__all__ = ["BF16_Optimizer", "DeepSpeedOptimizer", "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3",
           "FP16_Optimizer", "FP16_UnfusedOptimizer", "ZeROOptimizer"]


class DeepSpeedOptimizer:
    """Base of DeepSpeed's optimizer wrappers; deepshard has none (see the module docstring)."""

    replacement = "deepshard's engine does this for the torch optimizer itself (engine.optimizer is that optimizer)"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} is DeepSpeed's optimizer wrapper; deepshard does not wrap "
                                  f"optimizers: {self.replacement}. Build the engine with deepshard.initialize instead")


class ZeROOptimizer(DeepSpeedOptimizer):
    """DeepSpeed's ZeRO optimizer base."""

    replacement = "ZeRO partitions the optimizer state inside the engine (zero_optimization.stage)"


class DeepSpeedZeroOptimizer(ZeROOptimizer):
    """DeepSpeed's ZeRO stage 1/2 optimizer."""


class DeepSpeedZeroOptimizer_Stage3(ZeROOptimizer):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's ZeRO stage 3 optimizer."""


class BF16_Optimizer(ZeROOptimizer):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's bf16 optimizer (fp32 master weights)."""

    replacement = "bf16 training keeps fp32 master weights inside the engine (the bf16 section)"


class FP16_Optimizer(DeepSpeedOptimizer):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's fused fp16 optimizer (loss scaling, fp32 master weights)."""

    replacement = "fp16 training scales the loss and keeps fp32 master weights inside the engine (the fp16 section)"


class FP16_UnfusedOptimizer(FP16_Optimizer):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's unfused fp16 optimizer."""
