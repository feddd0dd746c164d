"""``deepspeed.utils.torch``: torch version and capability checks code written for DeepSpeed calls."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.torch_version import TorchVersion

__all__ = ["is_functorch_transforming", "register_grad_hook", "required_torch_version"]


def required_torch_version(min_version: Any = None, max_version: Any = None) -> bool:
    """Whether the installed torch is at least ``min_version`` and at most ``max_version`` (either may be
    left out, not both; ``2.1`` and ``"2.1"`` both work)."""
    if not (min_version or max_version):
        raise ValueError("required_torch_version needs min_version or max_version")
    installed = TorchVersion(torch.__version__)  # compares with version strings (torch's own parser)
    if min_version and installed < str(min_version):
        return False
    return not (max_version and installed > str(max_version))


def is_functorch_transforming() -> bool:
    """Whether the caller runs under a torch.func transform (grad, vmap, jacrev ...)."""
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None) if functorch is not None else None
    return peek is not None and peek() is not None


def register_grad_hook(param: torch.nn.Parameter, hook: Callable[[torch.nn.Parameter], None]) -> Any:
    """Call ``hook(param)`` after each backward has accumulated ``param.grad``; returns the handle."""
    return param.register_post_accumulate_grad_hook(hook)
