"""LAMB: layer-wise adaptive moments for large-batch training.

You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes"
(arXiv:1904.00962), Algorithm 2. Per parameter tensor ``w`` with gradient ``g`` at step ``t``:

    m = beta1 * m + (1 - beta1) * g                      # exp_avg
    v = beta2 * v + (1 - beta2) * g * g                  # exp_avg_sq
    m_hat = m / (1 - beta1 ** t),  v_hat = v / (1 - beta2 ** t)     (if bias_correction)
    u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w  # eps_inside_sqrt: sqrt(v_hat + eps)
    r = clamp(||w|| / ||u||, min_coeff, max_coeff)       # trust ratio; 1.0 if ||w|| or ||u|| is 0
    w = w - lr * r * u

The hyperparameters, their defaults and the zero-norm rule are those of DeepSpeed's ``FusedLamb``
(the optimizer its config type ``"Lamb"`` selects), so a DeepSpeed config gives the same update.
The trust ratio is computed per parameter tensor, which is the "layer" of the paper.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["Lamb"]


def _check_range(name: str, value: float, low: float, high: float | None = None) -> None:
    """Raise a ValueError naming ``name`` unless ``low <= value`` (and ``value < high``)."""
    ok = value >= low and (high is None or value < high)
    if not ok:
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"Lamb: {name}={value} is invalid; it must be {bound}")


class Lamb(torch.optim.Optimizer):
    """LAMB optimizer (Adam moments scaled per tensor by a clamped trust ratio).

    Args:
        params: parameters or parameter-group dicts.
        lr: learning rate.
        bias_correction: divide the moments by ``1 - beta ** step``.
        betas: decay rates of the first and second moments (a list is accepted).
        eps: added to the denominator (outside the square root unless ``eps_inside_sqrt``).
        eps_inside_sqrt: use ``sqrt(v_hat + eps)`` instead of ``sqrt(v_hat) + eps``.
        weight_decay: decoupled weight decay, added to the update before the trust ratio.
        max_coeff: upper clamp of the trust ratio.
        min_coeff: lower clamp of the trust ratio.
        amsgrad: accepted for DeepSpeed-config compatibility; only ``False`` is supported.

    State per parameter: ``step`` (int), ``exp_avg``, ``exp_avg_sq`` (same shape and dtype as the
    parameter). After each ``step()``, :meth:`get_lamb_coeffs` gives the trust ratio applied to
    each updated tensor, in parameter order.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError("Lamb: amsgrad=True is not supported (DeepSpeed's FusedLamb does not "
                             "support it either); remove 'amsgrad' or set it to false")
        betas = tuple(betas)
        if len(betas) != 2:
            raise ValueError(f"Lamb: betas must have 2 values (beta1, beta2), got {list(betas)}")
        _check_range("lr", lr, 0.0)
        _check_range("betas[0]", betas[0], 0.0, 1.0)
        _check_range("betas[1]", betas[1], 0.0, 1.0)
        _check_range("eps", eps, 0.0)
        _check_range("weight_decay", weight_decay, 0.0)
        _check_range("min_coeff", min_coeff, 0.0)
        if max_coeff < min_coeff:
            raise ValueError(f"Lamb: max_coeff ({max_coeff}) must be >= min_coeff ({min_coeff})")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                        max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)
        self._lamb_coeffs: list[torch.Tensor] = []

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios applied by the last ``step()``, one per updated parameter tensor."""
        return [float(c) for c in self._lamb_coeffs]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Apply one LAMB update to every parameter that has a gradient.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._lamb_coeffs = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients; use a dense "
                                       "embedding (sparse=False) or torch.optim.SparseAdam")
                self._lamb_coeffs.append(self._update(p, group))
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Update one tensor in place; return its trust ratio as a 0-dim tensor."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        step = state["step"]
        beta1, beta2 = group["betas"]
        grad = p.grad
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)

        correction1 = 1.0 - beta1 ** step if group["bias_correction"] else 1.0
        correction2 = 1.0 - beta2 ** step if group["bias_correction"] else 1.0
        v_hat = exp_avg_sq / correction2
        if group["eps_inside_sqrt"]:
            denom = v_hat.add_(group["eps"]).sqrt_()
        else:
            denom = v_hat.sqrt_().add_(group["eps"])
        update = (exp_avg / correction1).div_(denom)
        if group["weight_decay"] != 0:
            update.add_(p, alpha=group["weight_decay"])

        w_norm = torch.linalg.vector_norm(p)
        u_norm = torch.linalg.vector_norm(update)
        ratio = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
        ratio = torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
        p.sub_(update.mul_(ratio * group["lr"]))
        return ratio
