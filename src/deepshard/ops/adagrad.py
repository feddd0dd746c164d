"""``deepspeed.ops.adagrad``: ``DeepSpeedCPUAdagrad`` with DeepSpeed's signature, on torch's Adagrad."""
from __future__ import annotations

from typing import Any, Iterable

import torch


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's CPU Adagrad (no initial accumulator, no lr decay, as DeepSpeed's kernel)."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10,
                 weight_decay: float = 0.0, amsgrad: bool = False, fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise NotImplementedError("DeepSpeedCPUAdagrad(amsgrad=True) is not an Adagrad option (DeepSpeed "
                                      "rejects it too); drop amsgrad")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)


__all__ = ["DeepSpeedCPUAdagrad"]
