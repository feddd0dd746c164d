"""Loss scaling for fp16 training (Micikevicius et al. 2018, "Mixed Precision Training").

The dynamic scaler multiplies the loss by ``scale`` so small fp16 gradients do not flush to zero. When a
step's gradients overflow (inf/nan) the step is skipped and the scale lowered; after ``scale_window``
clean steps it is raised again. ``hysteresis`` lets that many overflows pass before the scale is lowered
(DeepSpeed's "delayed shift"); ``consecutive_hysteresis`` restores the allowance after every clean step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepshard.utils.logging import logger


@dataclass
class StaticLossScaler:
    """A fixed scale (``fp16.loss_scale`` > 0, or 1.0 when loss scaling is not used)."""

    scale: float = 1.0

    @property
    def dynamic(self) -> bool:
        return False

    def update(self, overflow: bool) -> None:
        """A static scale never changes; overflowing steps are still skipped by the engine."""

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "static", "scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])


@dataclass
class DynamicLossScaler:
    """DeepSpeed-compatible dynamic loss scaling (keys of the ``fp16`` config section)."""

    scale: float = 2.0 ** 16
    scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    factor: float = 2.0

    def __post_init__(self) -> None:
        if self.scale <= 0 or self.min_scale <= 0:
            raise ValueError(f"loss scale ({self.scale}) and min_loss_scale ({self.min_scale}) must be > 0")
        if self.hysteresis < 1:
            raise ValueError(f"fp16.hysteresis ({self.hysteresis}) must be >= 1")
        self.iteration = 0
        self.last_overflow_iteration = -1
        self.hysteresis_left = self.hysteresis

    @property
    def dynamic(self) -> bool:
        return True

    def update(self, overflow: bool) -> None:
        """Advance one optimizer step, lowering the scale on overflow and raising it after a clean window."""
        if overflow:
            if self.hysteresis_left <= 1:
                new_scale = max(self.scale / self.factor, self.min_scale)
                if new_scale == self.scale:
                    logger.warning(
                        "fp16 loss scale is already at its minimum (%g) and gradients still overflow; "
                        "lower the learning rate, check the data for inf/nan, or train in bf16", self.scale)
                self.scale = new_scale
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if (self.iteration - self.last_overflow_iteration) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= self.factor
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "dynamic", "scale": self.scale, "iteration": self.iteration,
                "last_overflow_iteration": self.last_overflow_iteration,
                "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.iteration = int(state.get("iteration", 0))
        self.last_overflow_iteration = int(state.get("last_overflow_iteration", -1))
        self.hysteresis_left = int(state.get("hysteresis_left", self.hysteresis))


LossScaler = StaticLossScaler | DynamicLossScaler


def make_loss_scaler(fp16_cfg: Any) -> LossScaler:
    """Build the scaler from the ``fp16`` config section (a static scale of 1 when fp16 is off)."""
    if not getattr(fp16_cfg, "enabled", False):
        return StaticLossScaler(1.0)
    if fp16_cfg.loss_scale and fp16_cfg.loss_scale > 0:
        return StaticLossScaler(float(fp16_cfg.loss_scale))
    return DynamicLossScaler(scale=2.0 ** fp16_cfg.initial_scale_power,
                             scale_window=fp16_cfg.loss_scale_window,
                             hysteresis=fp16_cfg.hysteresis,
                             consecutive_hysteresis=fp16_cfg.consecutive_hysteresis,
                             min_scale=float(fp16_cfg.min_loss_scale))
