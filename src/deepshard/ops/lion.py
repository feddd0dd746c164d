"""``deepspeed.ops.lion``: ``DeepSpeedCPULion`` and ``FusedLion`` on deepshard's Lion."""
from __future__ import annotations

from typing import Any, Iterable

from deepshard.optim.lion import Lion


class DeepSpeedCPULion(Lion):
    """DeepSpeed's CPU Lion: deepshard's :class:`~deepshard.optim.lion.Lion` under DeepSpeed's name."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, fp32_optimizer_states: bool = True) -> None:
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)


class FusedLion(DeepSpeedCPULion):
    """DeepSpeed's fused Lion: the same update."""


__all__ = ["DeepSpeedCPULion", "FusedLion"]
