"""Which dtype the model computes in and whether fp32 master weights are kept."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PrecisionPolicy:
    """``param_dtype``: the dtype of the module's parameters (and so of its gradients);
    ``master_dtype``: the dtype the optimizer updates in (fp32 whenever params are 16-bit);
    ``comm_dtype``: the dtype gradients are reduced in (``communication_data_type``);
    ``buffer_dtype``: the dtype floating-point buffers are cast to (``data_types.buffer_dtype``; None
    keeps each buffer's own dtype, see ``precision/cast.py``)."""

    param_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32
    comm_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None

    @property
    def keeps_master_weights(self) -> bool:
        return self.param_dtype != self.master_dtype

    @property
    def fp16(self) -> bool:
        return self.param_dtype == torch.float16

    def cast_inputs(self, value: Any) -> Any:
        """Cast floating-point tensors (nested in tuples/lists/dicts) to ``param_dtype``."""
        if self.param_dtype == torch.float32:
            return value
        if isinstance(value, torch.Tensor):
            return value.to(self.param_dtype) if value.is_floating_point() else value
        if isinstance(value, (list, tuple)):
            return type(value)(self.cast_inputs(v) for v in value)
        if isinstance(value, dict):
            return {k: self.cast_inputs(v) for k, v in value.items()}
        return value
