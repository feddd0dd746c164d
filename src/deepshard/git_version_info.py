"""``deepspeed.git_version_info`` under deepshard: what DeepSpeed's build records, answered for deepshard.

``version`` is the DeepSpeed contract version with deepshard's as its local label (as the ``deepspeed``
distribution reports it), ``installed_ops`` is empty (deepshard compiles no ops: its optimizers are
PyTorch's), ``accelerator_name`` is the device kind this process uses."""
from __future__ import annotations

from typing import Any

import torch

from deepshard import _version
from deepshard.compat.finder import shim_version
from deepshard.ops import op_builder as _op_builder

__all__ = ["accelerator_name", "compatible_ops", "git_branch", "git_hash", "installed_ops", "torch_info", "version"]

version: str = shim_version()
git_hash: str = _version.__git_hash__
git_branch: str = _version.__git_branch__
installed_ops: dict[str, bool] = {}
compatible_ops: dict[str, bool] = _op_builder.compatible_ops()
torch_info: dict[str, Any] = {
    "version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
    "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
    "cuda_version": torch.version.cuda or "0.0",
    "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "0.0",
    "hip_version": torch.version.hip or "0.0",
}


def __getattr__(name: str) -> Any:
    if name == "accelerator_name":
        from deepshard.accelerator import get_accelerator

        return get_accelerator().device_name()
    raise AttributeError(f"module 'deepshard.git_version_info' has no attribute {name!r}")
