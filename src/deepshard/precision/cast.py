"""Casting a model to its training dtype: parameters always, buffers only when configured.

Buffers keep their own dtype unless ``data_types.buffer_dtype`` names one (as DeepSpeed does since
v0.19.2): a buffer is usually a constant the model computes with, such as LLaMA's rotary ``inv_freq``,
whose bf16 rounding would change every logit, or a running statistic accumulated over many steps.
``module.to(dtype)`` casts both, so the strategies call these instead.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Floating-point parameters (and any gradients they hold) to ``dtype``, in place: the
    ``Parameter`` objects stay the same, so optimizers and hooks that hold them keep working."""
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            if p.grad is not None:
                p.grad = p.grad.to(dtype)


@torch.no_grad()
def cast_buffers(module: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Floating-point buffers to ``dtype``; ``None`` keeps every buffer's dtype."""
    if dtype is None:
        return
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                m._buffers[name] = b.to(dtype)


def cast_module(module: torch.nn.Module, param_dtype: torch.dtype, buffer_dtype: torch.dtype | None) -> None:
    """Parameters to ``param_dtype``, buffers to ``buffer_dtype`` (None: kept)."""
    cast_parameters(module, param_dtype)
    cast_buffers(module, buffer_dtype)


def cast_for_training(module: torch.nn.Module, param_dtype: torch.dtype | None, buffer_dtype: torch.dtype | None,
                      params_already_placed: bool = False) -> None:
    """Parameters to ``param_dtype`` (None, or parameters ZeRO-3's ``Init`` already built in their dtype:
    left alone), floating-point buffers to ``buffer_dtype`` (None: kept)."""
    if param_dtype is not None and not params_already_placed:
        cast_parameters(module, param_dtype)
    cast_buffers(module, buffer_dtype)
