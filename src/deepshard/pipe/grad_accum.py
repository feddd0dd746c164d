"""fp32 gradient accumulation for 16-bit pipeline stages (DeepSpeed's ``data_types.grad_accum_dtype``,
fp32 by default for bf16 / fp16 pipelines).

A pipeline stage sums the gradients of all ``gradient_accumulation_steps`` micro-batches locally before
the one reduction. In bf16 (8 bits of mantissa) each of those additions rounds: a micro-batch's gradient
smaller than 1/256 of the running sum is lost whole. Here every micro-batch's gradient is added into an
fp32 sum as soon as autograd (or the zero-bubble weight pass) has produced it, and ``.grad`` is zeroed
again; ``flush()`` writes each sum back into ``.grad`` once, rounded once, before the reduction.
"""
from __future__ import annotations

from typing import Iterable

import torch

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


class Fp32GradSums:
    """fp32 sums of the 16-bit trainable parameters' gradients over one batch's micro-batches.

    Its hooks must run after any other post-accumulate hook on the parameters (the ZeRO strategy's,
    registered when it was built): build it after the strategy."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad and p.dtype in SIXTEEN_BIT]
        self.sums: dict[int, torch.Tensor] = {}
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def _on_grad(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self.add(param, param.grad)
            param.grad.zero_()  # kept (a ZeRO buffer view may be bound to it); the next micro-batch adds to 0

    def add(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Add one micro-batch's gradient of ``param`` (the zero-bubble weight pass calls this directly)."""
        total = self.sums.get(id(param))
        if total is None:
            self.sums[id(param)] = grad.detach().float().clone()
        else:
            total.add_(grad.detach())

    @torch.no_grad()
    def flush(self) -> None:
        """Every parameter that got a gradient this batch: ``.grad`` = its fp32 sum (plus anything that
        reached ``.grad`` another way), rounded once to the parameter's dtype. Parameters that got none
        keep ``.grad`` as it is (None stays None: optimizers skip them). The sums start again at zero."""
        for p in self.params:
            total = self.sums.pop(id(p), None)
            if total is None:
                continue
            if p.grad is None:
                p.grad = total.to(p.dtype)
            else:
                p.grad.copy_(total.add_(p.grad))

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.sums.clear()
