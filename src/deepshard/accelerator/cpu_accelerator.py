"""``deepspeed.accelerator.cpu_accelerator``: DeepSpeed's CPU accelerator class, for code that builds one and
hands it to ``set_accelerator`` (``set_accelerator(CPU_Accelerator())``)."""
from __future__ import annotations

from deepshard.accelerator import DeviceAccelerator

__all__ = ["CPU_Accelerator"]


class CPU_Accelerator(DeviceAccelerator):  # noqa: N801 (DeepSpeed's class name)
    """deepshard's accelerator of kind ``"cpu"`` under DeepSpeed's class name."""

    def __init__(self) -> None:
        super().__init__("cpu", 0)
