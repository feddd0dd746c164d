"""``deepspeed.OnDevice``: build a model's tensors directly on a device and in a dtype.

    with OnDevice(dtype=torch.float16, device="meta"):
        model = MyModel()          # every parameter a float16 meta tensor: no memory, shapes only

Inside the block, factory functions that are not given a device create on ``device`` (torch's own
device context), and floating-point tensors created without an explicit dtype are ``dtype`` (torch's
default dtype, restored on exit). ``enabled=False`` makes the block a no-op.
"""
from __future__ import annotations

from types import TracebackType
from typing import Any

import torch

__all__ = ["OnDevice"]


class OnDevice:
    """A context manager placing newly created tensors on ``device`` in ``dtype`` (module docstring)."""

    def __init__(self, dtype: torch.dtype | None, device: Any = "meta", enabled: bool = True) -> None:
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"OnDevice(dtype={dtype}) needs a floating-point dtype (the dtype of new "
                             "floating-point tensors), e.g. torch.float16, or None to keep torch's default")
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._saved_dtype: torch.dtype | None = None
        self._device_mode: Any = None

    def __enter__(self) -> "OnDevice":
        if self.enabled:
            self._saved_dtype = torch.get_default_dtype()
            if self.dtype is not None:
                torch.set_default_dtype(self.dtype)
            self._device_mode = self.device
            self._device_mode.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self.enabled and self._device_mode is not None:
            self._device_mode.__exit__(kind, value, traceback)
            self._device_mode = None
            torch.set_default_dtype(self._saved_dtype)
