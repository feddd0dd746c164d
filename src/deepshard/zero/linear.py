"""``deepspeed.runtime.zero.linear``: DeepSpeed's stage-3 linear function, ``zero3_linear_wrap(input, weight,
bias)``, as an autograd function of its own.

It computes ``F.linear`` and keeps for backward only the tensors it was given (the input, and the weight
parameter itself, whose values a ZeRO-3 hook gathers again before backward), not a transposed or cast copy.
Backward runs under the autocast state forward ran under (autocast on in forward: the gradients are computed
in its dtype; off: in the inputs' dtype, even inside an autocast region around ``backward()``); the gradients
come back in each input's own dtype. It works under ``torch.func`` transforms (``grad``, ``vmap``): the
context is set up in ``setup_context``, apart from ``forward``.

deepshard's ZeRO-3 does not need it (its hooks gather a weight for backward whatever function used it, and
``torch.nn.functional.linear`` is left as it is); it is here for code that calls it by name.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["LinearFunctionForZeroStage3", "zero3_linear_wrap"]


class LinearFunctionForZeroStage3(torch.autograd.Function):
    """``F.linear`` whose backward reuses the saved input and weight (see the module docstring)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(input: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(input, weight, bias)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        input, weight = inputs[0], inputs[1]
        bias = inputs[2] if len(inputs) > 2 else None
        ctx._device_type = input.device.type
        ctx._fwd_used_autocast = torch.is_autocast_enabled(input.device.type)
        ctx._dtype = torch.get_autocast_dtype(input.device.type) if ctx._fwd_used_autocast else output.dtype
        ctx._has_bias = bias is not None
        ctx.save_for_backward(input, weight)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        with torch.autocast(device_type=ctx._device_type, dtype=ctx._dtype, enabled=ctx._fwd_used_autocast):
            if ctx.needs_input_grad[0]:
                grad_input = grad_output.matmul(weight)
            rows = grad_output.reshape(-1, grad_output.shape[-1])
            if ctx.needs_input_grad[1]:
                grad_weight = rows.t().matmul(input.reshape(-1, input.shape[-1]))
            if ctx._has_bias and ctx.needs_input_grad[2]:
                grad_bias = rows.sum(0)
        return grad_input, grad_weight, grad_bias


def zero3_linear_wrap(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``input @ weight.T + bias`` through :class:`LinearFunctionForZeroStage3`."""
    return LinearFunctionForZeroStage3.apply(input, weight, bias)
