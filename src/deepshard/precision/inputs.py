"""What the engine does to the dtypes of the inputs it passes to the model: DeepSpeed's rule, and the
error a user sees when the inputs do not fit the model's dtype.

DeepSpeed 0.19.8 (``runtime/engine.py``: ``_forward_prologue``, ``_cast_inputs_half``) hands the model its
inputs unchanged, except that with ``"fp16": {"auto_cast": true}`` the floating-point tensors among the
*positional* inputs (nested in lists, tuples and dicts) are cast to fp16; keyword inputs are never cast, and
bf16 training never casts. deepshard does the same, so a script moves between the two unchanged, with one
difference: ``auto_cast`` acts only when fp16 training is enabled (DeepSpeed casts to fp16 even for a bf16 or
fp32 model, which then refuses the inputs); ``config/inert.py`` warns about that setting.

An fp32 input reaching a bf16 ``Linear`` makes torch raise "mat1 and mat2 must have the same dtype", which
says neither why (the engine did not cast) nor what to do. :func:`explain_input_dtype_errors` re-raises such
an error as :class:`InputDtypeMismatch`, naming the dtypes and the fix, when the inputs did hold floating
tensors of another dtype than the model's.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

DTYPE_WORDS = ("dtype", "scalar type", "should be the same")
"""Words of torch's dtype-mismatch errors ("mat1 and mat2 must have the same dtype", "expected scalar type
BFloat16 but found Float", "Input type (float) and bias type (c10::BFloat16) should be the same")."""


class InputDtypeMismatch(RuntimeError):
    """The model's forward refused its inputs' dtype; the message names the dtypes and the fix."""


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it (nested in lists, tuples, named tuples and dicts)
    cast to ``dtype``; anything else unchanged."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple takes its fields one by one
        return type(value)(*(cast_floating(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    return value


def floating_dtypes(value: Any) -> set[torch.dtype]:
    """The dtypes of the floating-point tensors in ``value`` (nested as :func:`cast_floating` walks)."""
    if isinstance(value, torch.Tensor):
        return {value.dtype} if value.is_floating_point() else set()
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    found: set[torch.dtype] = set()
    for item in items:
        found |= floating_dtypes(item)
    return found


def is_dtype_mismatch(error: BaseException) -> bool:
    """Whether torch's ``error`` complains about mixed dtypes (not shapes)."""
    message = str(error)
    return any(word in message for word in DTYPE_WORDS)


def mismatch_message(error: BaseException, model_dtype: torch.dtype, input_dtypes: set[torch.dtype],
                     fp16_without_auto_cast: bool) -> str:
    """The text of :class:`InputDtypeMismatch`: torch's message, then what happened and how to fix it."""
    others = ", ".join(sorted(str(d) for d in input_dtypes if d != model_dtype))
    fix = f"cast them before the call, e.g. x.to({model_dtype})"
    if fp16_without_auto_cast:
        fix += ', or set "fp16": {"auto_cast": true} so the engine casts floating-point positional inputs to fp16'
    return (f"{error}\n(deepshard) the model computes in {model_dtype}, but its inputs hold floating-point tensors "
            f"of {others}. Like DeepSpeed, the engine passes inputs to the model unchanged (it casts them only "
            f"with fp16.auto_cast under fp16 training); {fix}")


@contextlib.contextmanager
def explain_input_dtype_errors(inputs: Any, model_dtype: torch.dtype,
                               fp16_without_auto_cast: bool = False) -> Iterator[None]:
    """Re-raise torch's dtype-mismatch ``RuntimeError`` of the forward as :class:`InputDtypeMismatch` (chained to
    the original) when ``inputs`` held floating tensors of another dtype than ``model_dtype``; any other
    error passes through unchanged."""
    try:
        yield
    except RuntimeError as exc:
        # torch raises a plain RuntimeError; subclasses are deepshard's own (a collective's timeout, this one)
        if type(exc) is not RuntimeError or not is_dtype_mismatch(exc):
            raise
        found = floating_dtypes(inputs)
        if not found - {model_dtype}:
            raise
        raise InputDtypeMismatch(mismatch_message(exc, model_dtype, found, fp16_without_auto_cast)) from exc
