"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` and ``FusedAdam`` with DeepSpeed's signatures, on torch's
Adam (``adamw_mode=True``: decoupled weight decay, i.e. AdamW; False: L2 weight decay, i.e. Adam).
``FusedAdam`` lives in ``deepshard.optim.fused_adam`` (the config's optimizer factory builds it)."""
from __future__ import annotations

from typing import Any, Iterable

import torch

from deepshard.optim.fused_adam import FusedAdam, adam_kwargs as _adam_kwargs


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's CPU Adam: torch's Adam with its fused kernel (one vectorised, multi-threaded pass on the
    CPU, as DeepSpeed's own CPU Adam), on whatever device the parameters are; ``fp32_optimizer_states`` is
    accepted: deepshard keeps optimizer states in fp32 anyway."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        super().__init__(model_params, **_adam_kwargs(type(self).__name__, lr, bias_correction, betas, eps,
                                                      weight_decay, amsgrad, adamw_mode), fused=True)
        self.adamw_mode = adamw_mode


__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
