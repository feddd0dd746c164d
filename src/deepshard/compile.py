"""``torch.compile``d models in ``deepshard.initialize``: train the original module, compiled in place.

``torch.compile(model)`` returns a wrapper (``OptimizedModule``) whose parameters are named
``_orig_mod.<name>``. Handing that wrapper to the engine would key checkpoints by those names, so a
checkpoint of a compiled run would not load into the plain model and back. :func:`adopt_compiled`
instead takes the original module and compiles its ``__call__`` in place with the wrapper's own
compiler settings (what ``nn.Module.compile()`` does): the engine, the ZeRO strategies and the
checkpoints see the original names, and every call still goes through the compiled code.
"""
from __future__ import annotations

from typing import Any

import torch


def is_compiled_wrapper(model: Any) -> bool:
    """True for the wrapper ``torch.compile(module)`` returns (without importing ``torch._dynamo``)."""
    return type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod")


def adopt_compiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module to train: ``model`` itself, or, for ``torch.compile(module)``, ``module`` with its
    ``__call__`` compiled in place by the same compiler settings (backend, mode, options)."""
    if not is_compiled_wrapper(model):
        return model
    original: torch.nn.Module = model._orig_mod
    dynamo_ctx = getattr(model, "dynamo_ctx", None)
    if dynamo_ctx is None or not callable(dynamo_ctx):
        raise TypeError(
            f"deepshard.initialize got a torch.compile wrapper ({type(model).__name__}) of torch "
            f"{torch.__version__} without the compiler context deepshard reuses; pass the plain module "
            "and call engine.compile() (or module.compile()) instead")
    original._compiled_call_impl = dynamo_ctx(original._call_impl)
    return original


def compile_module(module: torch.nn.Module, backend: str | Any = "inductor",
                   compile_kwargs: dict[str, Any] | None = None) -> None:
    """Compile ``module``'s ``__call__`` in place (DeepSpeed's ``engine.compile(backend, compile_kwargs)``);
    parameter names, hooks and checkpoints are unchanged."""
    module.compile(backend=backend, **(compile_kwargs or {}))


def module_is_compiled(module: torch.nn.Module) -> bool:
    """True when calls to ``module`` go through ``torch.compile`` (DeepSpeed's ``engine.is_compiled``)."""
    return getattr(module, "_compiled_call_impl", None) is not None
