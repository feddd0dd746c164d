"""The split backward of zero-bubble schedules at the operator level (Qi et al. 2024, section 2): during a
micro-batch's forward every ``F.linear`` whose weight needs a gradient runs through ``DeferredLinear``,
whose backward computes only the input gradient and records ``(input, output gradient)``; the weight
and bias gradients (two GEMMs) run later, in the schedule's weight pass, from that record.

So the input pass (``BACKWARD_INPUT``) is one ordinary autograd backward without the linear layers' weight
GEMMs (other parameters — norms, embeddings — get their gradients there, they are cheap), and the weight
pass (``BACKWARD_WEIGHT``) is those GEMMs alone: no part of the backward is computed twice.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class WeightGradStore:
    """One micro-batch's deferred weight-gradient work. ``accumulate(param, grad)`` adds a computed
    gradient where the batch's gradients are summed (default: into ``param.grad``; a 16-bit pipeline
    passes its fp32 sums, ``grad_accum.Fp32GradSums.add``)."""

    def __init__(self, accumulate: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.nn.Parameter, Any]] = []
        self.accumulate = accumulate or _accumulate

    @torch.no_grad()
    def run(self) -> None:
        """Compute and accumulate every recorded weight (and bias) gradient, then forget the records."""
        for x, grad_out, weight, bias in self.pending:
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            self.accumulate(weight, g2.t().mm(x.reshape(-1, x.shape[-1]).to(g2.dtype)).to(weight.dtype))
            if bias is not None and bias.requires_grad:
                self.accumulate(bias, g2.sum(0).to(bias.dtype))
        self.pending.clear()


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose backward returns the input gradient only and records the rest in ``store``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                store: WeightGradStore) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.store = weight, bias, store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        grad_x = grad_out.matmul(ctx.weight.to(grad_out.dtype)) if ctx.needs_input_grad[0] else None
        ctx.store.pending.append((x, grad_out, ctx.weight, ctx.bias))
        return grad_x, None, None, None


class DeferWeightGrads(TorchFunctionMode):
    """Inside this mode, linear layers with trainable weights record their weight gradients in ``store``."""

    def __init__(self, store: WeightGradStore) -> None:
        super().__init__()
        self.store = store

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(weight, torch.nn.Parameter) and weight.requires_grad:
                return DeferredLinear.apply(x, weight, bias, self.store)
        return func(*args, **kwargs)
