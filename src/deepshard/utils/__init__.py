"""User-facing helpers with DeepSpeed's names (``deepspeed.utils``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepshard.utils.logging import logger

if TYPE_CHECKING:  # torch is imported lazily so the launcher starts fast
    import torch

__all__ = ["OnDevice", "RepeatingLoader", "logger", "safe_get_full_fp32_param", "safe_get_full_grad",
           "safe_get_full_optimizer_state", "set_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module",
           "get_z3_leaf_modules"]


def set_z3_leaf_modules(model: "torch.nn.Module", leaf_module_classes: list) -> list:
    """Mark every submodule of ``model`` whose class is in ``leaf_module_classes`` (classes or class names)
    as a ZeRO-3 leaf: its whole subtree is gathered at once around its forward (for modules that read
    their children's parameters directly, or mixture-of-experts layers that call only some experts).
    Call it before ``deepshard.initialize``. Returns the modules marked."""
    marked = []
    for m in model.modules():
        if any((isinstance(c, str) and type(m).__name__ == c) or (isinstance(c, type) and isinstance(m, c))
               for c in leaf_module_classes):
            m._z3_leaf = True
            marked.append(m)
    if not marked:
        raise ValueError(f"no submodule of {type(model).__name__} is an instance of {leaf_module_classes}")
    return marked


def unset_z3_leaf_modules(model: "torch.nn.Module", leaf_module_classes: list) -> list:
    """Undo ``set_z3_leaf_modules`` for those classes."""
    marked = []
    for m in model.modules():
        if getattr(m, "_z3_leaf", False) and any(
                (isinstance(c, str) and type(m).__name__ == c) or (isinstance(c, type) and isinstance(m, c))
                for c in leaf_module_classes):
            m._z3_leaf = False
            marked.append(m)
    return marked


def z3_leaf_module(model: "torch.nn.Module") -> bool:
    """Whether ``model`` is a ZeRO-3 leaf."""
    return bool(getattr(model, "_z3_leaf", False))


def get_z3_leaf_modules(model: "torch.nn.Module") -> list:
    return [m for m in model.modules() if z3_leaf_module(m)]


def __getattr__(name: str) -> Any:
    if name == "RepeatingLoader":
        from deepshard.data import RepeatingLoader

        return RepeatingLoader
    if name == "OnDevice":
        from deepshard.utils.init_on_device import OnDevice

        return OnDevice
    from deepshard.compat.aliases import missing_attribute

    raise missing_attribute(__name__, name)


def _strategy_of(param: "torch.nn.Parameter"):  # noqa: ANN202 - returns a ZeroStrategy or None
    from deepshard.zero.strategy import owner_of

    return owner_of(param)


def safe_get_full_fp32_param(param: "torch.nn.Parameter") -> "torch.Tensor | None":
    """The full fp32 value of ``param`` (its master copy when training in 16 bits), on every rank."""
    strategy = _strategy_of(param)
    if strategy is None:
        return param.detach().float().clone()
    return strategy.full_fp32_param(param)


def safe_get_full_grad(param: "torch.nn.Parameter") -> "torch.Tensor | None":
    """The full reduced gradient of ``param`` (fp32) between backward and step, on every rank."""
    strategy = _strategy_of(param)
    if strategy is None:
        return None if param.grad is None else param.grad.detach().float().clone()
    return strategy.full_grad(param)


def safe_get_full_optimizer_state(param: "torch.nn.Parameter", optim_state_key: str) -> "torch.Tensor | None":
    """The full optimizer state ``optim_state_key`` (e.g. ``"exp_avg"``) of ``param``, on every rank."""
    strategy = _strategy_of(param)
    return None if strategy is None else strategy.full_optimizer_state(param, optim_state_key)
