"""``deepspeed.accelerator.cuda_accelerator``: DeepSpeed's CUDA accelerator class, for code that builds one and
hands it to ``set_accelerator`` (``set_accelerator(CUDA_Accelerator())``)."""
from __future__ import annotations

from deepshard.accelerator import DeviceAccelerator, cuda_index

__all__ = ["CUDA_Accelerator"]


class CUDA_Accelerator(DeviceAccelerator):  # noqa: N801 (DeepSpeed's class name)
    """deepshard's accelerator of kind ``"cuda"`` under DeepSpeed's class name; the device index is the local
    rank modulo the visible devices, as :func:`deepshard.accelerator.get_accelerator` picks it."""

    def __init__(self) -> None:
        super().__init__("cuda", cuda_index())
