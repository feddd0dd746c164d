"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` and ``FusedAdam`` with DeepSpeed's signatures, on torch's
Adam (``adamw_mode=True``: decoupled weight decay, i.e. AdamW; False: L2 weight decay, i.e. Adam)."""
from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch

_HAS_DECOUPLED = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam).parameters


def _adam_kwargs(name: str, lr: float, bias_correction: bool, betas: tuple[float, float], eps: float,
                 weight_decay: float, amsgrad: bool, adamw_mode: bool) -> dict[str, Any]:
    if not bias_correction:
        raise NotImplementedError(f"{name}(bias_correction=False) has no torch equivalent (torch's Adam always "
                                  "corrects the bias); use bias_correction=True")
    kwargs: dict[str, Any] = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                              "amsgrad": amsgrad}
    if adamw_mode and weight_decay:
        if not _HAS_DECOUPLED:
            raise NotImplementedError(f"{name}(adamw_mode=True, weight_decay={weight_decay}) needs torch's "
                                      "Adam(decoupled_weight_decay=...), added in torch 2.6; upgrade torch or "
                                      "use torch.optim.AdamW")
        kwargs["decoupled_weight_decay"] = True
    return kwargs


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


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's fused (multi-tensor) Adam: torch's Adam with ``foreach`` kernels."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        super().__init__(params, **_adam_kwargs(type(self).__name__, lr, bias_correction, betas, eps,
                                                weight_decay, amsgrad, adam_w_mode))
        self.adam_w_mode = adam_w_mode


__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
