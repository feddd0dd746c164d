"""Lion: EvoLved Sign Momentum.

Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms" (arXiv:2302.06675), Program 1.
Per parameter ``w`` with gradient ``g``:

    w = w * (1 - lr * weight_decay)                      # decoupled weight decay
    w = w - lr * sign(beta1 * m + (1 - beta1) * g)       # the update interpolates with beta1
    m = beta2 * m + (1 - beta2) * g                      # the momentum tracks with beta2

Only one state tensor (``exp_avg``) is kept, half of Adam's optimizer memory.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """Lion optimizer (sign of an interpolated momentum, decoupled weight decay).

    Args:
        params: parameters or parameter-group dicts.
        lr: learning rate (the paper suggests 3-10x smaller than AdamW's).
        betas: ``beta1`` interpolates the update, ``beta2`` decays the momentum (a list is
            accepted).
        weight_decay: decoupled weight decay; each step multiplies the weights by
            ``1 - lr * weight_decay``.

    State per parameter: ``exp_avg`` (same shape and dtype as the parameter).

    The defaults are the paper's (lr 1e-4, betas (0.9, 0.99)). ``build_optimizer("Lion", ...)``
    fills DeepSpeed's FusedLion defaults instead (lr 1e-3, betas (0.9, 0.999)) for a config that
    leaves them out, so a DeepSpeed config trains the same way.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        betas = tuple(betas)
        if len(betas) != 2:
            raise ValueError(f"Lion: betas must have 2 values (beta1, beta2), got {list(betas)}")
        if lr < 0.0:
            raise ValueError(f"Lion: lr={lr} is invalid; it must be >= 0")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Lion: betas[{i}]={beta} is invalid; it must be in [0, 1)")
        if weight_decay < 0.0:
            raise ValueError(f"Lion: weight_decay={weight_decay} is invalid; it must be >= 0")
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Apply one Lion update to every parameter that has a gradient.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs = self._collect(group)
            if params:
                self._update_group(group, params, grads, exp_avgs)
        return loss

    def _collect(self, group: dict[str, Any]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """The group's parameters that have gradients, their gradients and momenta."""
        params, grads, exp_avgs = [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Lion does not support sparse gradients; use a dense "
                                   "embedding (sparse=False) or torch.optim.SparseAdam")
            state = self.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
        return params, grads, exp_avgs

    @staticmethod
    def _update_group(group: dict[str, Any], params: list[torch.Tensor],
                      grads: list[torch.Tensor], exp_avgs: list[torch.Tensor]) -> None:
        """The Lion update for one group's tensors, with multi-tensor (foreach) kernels."""
        lr = float(group["lr"])
        beta1, beta2 = group["betas"]
        if group["weight_decay"] != 0:
            torch._foreach_mul_(params, 1.0 - lr * group["weight_decay"])
        updates = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_sign_(updates)
        torch._foreach_add_(params, updates, alpha=-lr)
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta2)
