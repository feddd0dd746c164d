"""User-facing helpers with DeepSpeed's names (``deepspeed.utils``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepshard.utils.logging import log_dist, logger, set_log_level_from_string
from deepshard.utils.z3_leaf_module import (get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules,
                                            set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix,
                                            unset_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter)
from deepshard.utils.tensor_fragment import (safe_get_local_fp32_param, safe_get_local_grad,
                                             safe_get_local_optimizer_state, safe_set_full_fp32_param,
                                             safe_set_full_grad, safe_set_full_optimizer_state,
                                             safe_set_local_fp32_param, safe_set_local_grad,
                                             safe_set_local_optimizer_state, safe_update_full_grad_vectorized)

if TYPE_CHECKING:  # torch is imported lazily so the launcher starts fast
    import torch

__all__ = ["OnDevice", "RepeatingLoader", "log_dist", "logger", "set_log_level_from_string", "safe_get_full_fp32_param", "safe_get_full_grad",
           "safe_get_full_optimizer_state", "set_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module",
           "get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "z3_leaf_parameter", "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_update_full_grad_vectorized", "safe_get_local_fp32_param", "safe_get_local_grad",
           "safe_get_local_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
           "safe_set_local_optimizer_state"]


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
    """The full fp32 value of ``param`` (its master copy when training in 16 bits), on every rank. None for a
    frozen parameter (``requires_grad`` False) of a model an engine trains, as in DeepSpeed: the optimizer
    holds no fp32 copy of it; read the parameter itself (under ZeRO-3 inside ``GatheredParameters``)."""
    strategy = _strategy_of(param)
    if strategy is None:
        return param.detach().float().clone()
    if not param.requires_grad:
        return None
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
