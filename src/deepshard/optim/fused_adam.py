"""DeepSpeed's ``FusedAdam`` (``deepspeed.ops.adam.FusedAdam``) on torch's Adam step, and the keyword
arguments DeepSpeed's Adam signatures translate to (``adam_kwargs``, shared with ``DeepSpeedCPUAdam`` in
``deepshard.ops.adam``). Here, beside the config's optimizer factory that builds it, so ``optim`` needs
nothing from ``ops``."""
from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch

_HAS_DECOUPLED = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam).parameters


def adam_kwargs(name: str, lr: float, bias_correction: bool, betas: tuple[float, float], eps: float,
                weight_decay: float, amsgrad: bool, adamw_mode: bool) -> dict[str, Any]:
    """torch's ``Adam`` keyword arguments for DeepSpeed's Adam arguments (``name``: the class, for errors)."""
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


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's fused (multi-tensor) Adam, on torch's Adam step (torch's kernel options ``foreach``,
    ``fused``, ``maximize``, ``capturable``, ``differentiable`` are passed on). What the config's ``"Adam"``
    builds (``deepshard.optim.factory``): a :class:`FusedAdamW` where ``adam_w_mode`` is on (DeepSpeed's
    default), this class with an L2 penalty where it is off."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True, *,
                 foreach: bool | None = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None) -> None:
        decoupled_by_class = isinstance(self, torch.optim.AdamW)  # AdamW's own __init__ decouples the decay
        if decoupled_by_class and not adam_w_mode:
            raise ValueError(f"{type(self).__name__} is Adam with decoupled weight decay (AdamW); for an L2 "
                             "penalty build FusedAdam(..., adam_w_mode=False)")
        kwargs = adam_kwargs(type(self).__name__, lr, bias_correction, betas, eps, weight_decay, amsgrad,
                             adam_w_mode and not decoupled_by_class)
        super().__init__(params, **kwargs, foreach=foreach, maximize=maximize, capturable=capturable,
                         differentiable=differentiable, fused=fused)
        self.adam_w_mode = adam_w_mode


class FusedAdamW(FusedAdam, torch.optim.AdamW):
    """:class:`FusedAdam` in ``adam_w_mode`` that is also a ``torch.optim.AdamW`` (the same update), so
    both DeepSpeed's ``isinstance(optimizer, FusedAdam)`` and torch-side ``isinstance(optimizer, AdamW)``
    hold for what the config's ``"Adam"`` and ``"AdamW"`` build."""
