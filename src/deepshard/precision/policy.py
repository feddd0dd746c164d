"""Which dtype the model computes in and whether fp32 master weights are kept."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from deepshard.precision.inputs import cast_floating, explain_input_dtype_errors


@dataclass(frozen=True)
class PrecisionPolicy:
    """``param_dtype``: the dtype of the module's parameters (and so of its gradients);
    ``master_dtype``: the dtype the optimizer updates in (fp32 whenever params are 16-bit);
    ``comm_dtype``: the dtype gradients are reduced in (``communication_data_type``);
    ``buffer_dtype``: the dtype floating-point buffers are cast to (``data_types.buffer_dtype``; None
    keeps each buffer's own dtype, see ``precision/cast.py``);
    ``auto_cast``: ``fp16.auto_cast`` with fp16 enabled (positional inputs cast to fp16, see ``cast_inputs``)."""

    param_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32
    comm_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    auto_cast: bool = False

    @property
    def keeps_master_weights(self) -> bool:
        return self.param_dtype != self.master_dtype

    @property
    def fp16(self) -> bool:
        return self.param_dtype == torch.float16

    def cast_inputs(self, inputs: Any) -> Any:
        """The positional inputs as the engine hands them to the model, by DeepSpeed's rule: floating-point
        tensors (nested in tuples/lists/dicts) cast to fp16 with ``fp16.auto_cast`` under fp16 training,
        otherwise unchanged (``precision/inputs.py`` says why; keyword inputs are never cast)."""
        return cast_floating(inputs, torch.float16) if self.auto_cast else inputs

    def forward_errors(self, inputs: Any) -> contextlib.AbstractContextManager[None]:
        """Around the model's call: torch's dtype-mismatch error re-raised with the dtypes and the fix when
        ``inputs`` (positional and keyword) hold floating tensors of another dtype than the parameters'."""
        return explain_input_dtype_errors(inputs, self.param_dtype,
                                          fp16_without_auto_cast=self.fp16 and not self.auto_cast)


class ParamDtypeConflict(ValueError, AssertionError):
    """``data_types.param_dtype`` names another dtype than the one fp16/bf16 train in (an AssertionError too:
    DeepSpeed asserts here)."""


def training_dtype(fp16: bool, bf16: bool) -> torch.dtype:
    """The dtype the model's parameters train in: fp16, bf16, else fp32."""
    return torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32


def mixed_precision_dtypes(buffer_dtype: str | None, fp16: bool, bf16: bool) -> tuple[torch.dtype | None,
                                                                                     torch.dtype | None]:
    """``(param_dtype, buffer_dtype)`` the module is cast to: the 16-bit training dtype (None in fp32
    training: nothing to cast) and ``data_types.buffer_dtype`` (None: buffers keep their own dtypes)."""
    from deepshard.config.base import dtype_from_name

    param = torch.float16 if fp16 else torch.bfloat16 if bf16 else None
    return param, (dtype_from_name(buffer_dtype) if buffer_dtype is not None else None)


def param_dtype_problem(param_dtype: str | None, fp16: bool, bf16: bool) -> str | None:
    """What is wrong with ``data_types.param_dtype`` given the fp16/bf16 flags (it must name the dtype they
    train in), or None."""
    if param_dtype is None:
        return None
    from deepshard.config.base import dtype_from_name

    trained = training_dtype(fp16, bf16)
    if dtype_from_name(param_dtype) == trained:
        return None
    return (f"data_types.param_dtype is {param_dtype!r}, but the parameters train in {trained} (set by the fp16 / bf16 "
            "sections); remove the key or set it to that dtype")


def check_param_dtype(param_dtype: str | None, fp16: bool, bf16: bool) -> None:
    """Raise :class:`ParamDtypeConflict` when :func:`param_dtype_problem` finds one."""
    problem = param_dtype_problem(param_dtype, fp16, bf16)
    if problem is not None:
        raise ParamDtypeConflict(problem)
