"""DeepSpeed's optimizer wrapper classes by name (``deepspeed.runtime.base_optimizer``, ``.bf16_optimizer``,
``.fp16.fused_optimizer``, ``.fp16.unfused_optimizer``, ``.zero.stage_1_and_2``, ``.zero.stage3``).

At ZeRO stages 1-3 ``engine.optimizer`` is the engine's ZeRO optimizer, an instance of DeepSpeed's classes
(``ZeROOptimizer``, and ``DeepSpeedZeroOptimizer`` at stages 1/2 or ``DeepSpeedZeroOptimizer_Stage3`` at
stage 3: ``deepshard.zero.zero_optimizer``), so ``isinstance`` checks and ``engine.optimizer.optimizer`` hold
as in DeepSpeed. At stage 0 ``engine.optimizer`` is the torch optimizer itself: deepshard does not wrap it in
DeepSpeed's bf16 / fp16 optimizers (the engine keeps the master weights and scales the loss), so no deepshard
object is a ``BF16_Optimizer`` or ``FP16_*``. Constructing any of these by hand is refused, saying where the
functionality is.
"""
from __future__ import annotations

from deepshard.zero.zero_optimizer import (DeepSpeedOptimizer, DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3,
                                           ZeROOptimizer)

__all__ = ["BF16_Optimizer", "DeepSpeedOptimizer", "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3",
           "FP16_Optimizer", "FP16_UnfusedOptimizer", "ZeROOptimizer"]


class BF16_Optimizer(ZeROOptimizer):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's bf16 optimizer (fp32 master weights)."""

    replacement = "bf16 training keeps fp32 master weights inside the engine (the bf16 section)"


class FP16_Optimizer(DeepSpeedOptimizer):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's fused fp16 optimizer (loss scaling, fp32 master weights)."""

    replacement = "fp16 training scales the loss and keeps fp32 master weights inside the engine (the fp16 section)"


class FP16_UnfusedOptimizer(FP16_Optimizer):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's unfused fp16 optimizer."""
