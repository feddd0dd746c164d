"""DeepSpeed's writers and per-rank (local) readers of the sharded training state (``deepspeed.utils``'s
``safe_set_full_*``, ``safe_update_full_grad_vectorized``, ``safe_get_local_*``, ``safe_set_local_*``).

- The *full* writers take the parameter's whole value and must be called on every rank with the same value
  (as DeepSpeed's): each rank keeps the parts it owns of the fp32 value (and puts the new value in the
  model), of the optimizer state or of the reduced gradient. Call them where the full readers are
  meaningful: gradients between ``backward`` and ``step``, optimizer states after the first step.
- The *local* calls read and write this rank's part only, at ZeRO stage 3: a 1-D fp32 tensor with
  ``param.ds_tensor.numel()`` elements (deepshard's part of a parameter may be of any length, 0
  included); they need no other rank.

Frozen parameters (``requires_grad=False``) have no optimizer-side copy: the writers leave them alone and
the local readers answer None, as DeepSpeed's do. ``zero/fragment_access.py`` has the mechanics.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:  # torch is imported lazily so the launcher starts fast
    import torch

__all__ = ["safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_update_full_grad_vectorized", "safe_get_local_fp32_param", "safe_get_local_grad",
           "safe_get_local_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
           "safe_set_local_optimizer_state"]


def _access(param: "torch.nn.Parameter") -> Any:
    """The strategy's writers for ``param``, or None when no engine trains it."""
    from deepshard.zero.strategy import owner_of

    strategy = owner_of(param)
    return None if strategy is None else strategy.fragment_access()


def _local_access(param: "torch.nn.Parameter", call: str) -> Any:
    from deepshard.zero.strategy import owner_of

    strategy = owner_of(param)
    if strategy is None or strategy.stage != 3:
        where = "no deepshard engine trains it" if strategy is None else \
            f"it is trained at ZeRO stage {strategy.stage}, where every rank holds it whole"
        raise TypeError(f"deepspeed.utils.{call} is defined for ZeRO stage 3 parameters only (as in DeepSpeed); "
                        f"{where}: use the safe_get_full_* / safe_set_full_* calls")
    return strategy.fragment_access()


def safe_set_full_fp32_param(param: "torch.nn.Parameter", value: "torch.Tensor") -> None:
    """Set the full fp32 value of ``param`` (its master copy when training in 16 bits, and the parameter)."""
    import torch

    access = _access(param)
    if access is not None:
        access.set_full_fp32_param(param, value)
        return
    with torch.no_grad():
        param.copy_(value.reshape(param.shape))


def safe_set_full_optimizer_state(param: "torch.nn.Parameter", value: "torch.Tensor", optim_state_key: str) -> None:
    """Set the full optimizer state ``optim_state_key`` (e.g. ``"exp_avg"``) of ``param``; it must exist (after
    the first step). A parameter no engine trains has no optimizer state here: left alone, as in DeepSpeed."""
    access = _access(param)
    if access is not None:
        access.set_full_optimizer_state(param, optim_state_key, value)


def safe_set_full_grad(param: "torch.nn.Parameter", value: "torch.Tensor") -> None:
    """Set the full reduced gradient of ``param`` (between ``backward`` and ``step``; the step uses it)."""
    import torch

    access = _access(param)
    if access is not None:
        access.set_full_grad(param, value)
    with torch.no_grad():
        if param.grad is not None and param.grad.shape == param.shape:  # stage 1 (views of its buffer), no ZeRO
            param.grad.copy_(value.reshape(param.shape))
        elif access is None:
            param.grad = value.detach().reshape(param.shape).to(param.dtype, copy=True)


def safe_update_full_grad_vectorized(param_list: Iterable["torch.nn.Parameter"],
                                     update_func: Callable[["torch.Tensor", "torch.nn.Parameter"], "torch.Tensor"]
                                     ) -> None:
    """Replace each trainable parameter's full gradient ``g`` by ``update_func(g, param)`` (every rank calls it
    with the same list: reading a full gradient is a collective)."""
    from deepshard.zero.strategy import owner_of

    for p in param_list:
        if p.requires_grad:
            strategy = owner_of(p)  # (what deepshard.utils.safe_get_full_grad reads)
            if strategy is not None:
                old = strategy.full_grad(p)
            else:
                old = None if p.grad is None else p.grad.detach().float()
            if old is not None:
                safe_set_full_grad(p, update_func(old, p))


def safe_get_local_fp32_param(param: "torch.nn.Parameter") -> "torch.Tensor | None":
    """This rank's part of the fp32 value of a ZeRO-3 parameter (None when frozen)."""
    return _local_access(param, "safe_get_local_fp32_param").local_fp32_param(param)


def safe_get_local_grad(param: "torch.nn.Parameter") -> "torch.Tensor | None":
    """This rank's part of the reduced gradient of a ZeRO-3 parameter (None when frozen)."""
    return _local_access(param, "safe_get_local_grad").local_grad(param)


def safe_get_local_optimizer_state(param: "torch.nn.Parameter", optim_state_key: str) -> "torch.Tensor | None":
    """This rank's part of the optimizer state ``optim_state_key`` of a ZeRO-3 parameter (None when frozen)."""
    return _local_access(param, "safe_get_local_optimizer_state").local_optimizer_state(param, optim_state_key)


def safe_set_local_fp32_param(param: "torch.nn.Parameter", value: "torch.Tensor") -> None:
    """Set this rank's part of the fp32 value of a ZeRO-3 parameter (and of its ``ds_tensor``)."""
    _local_access(param, "safe_set_local_fp32_param").set_local_fp32_param(param, value)


def safe_set_local_grad(param: "torch.nn.Parameter", value: "torch.Tensor") -> None:
    """Set this rank's part of the reduced gradient of a ZeRO-3 parameter."""
    _local_access(param, "safe_set_local_grad").set_local_grad(param, value)


def safe_set_local_optimizer_state(param: "torch.nn.Parameter", value: "torch.Tensor", optim_state_key: str) -> None:
    """Set this rank's part of the optimizer state ``optim_state_key`` of a ZeRO-3 parameter."""
    _local_access(param, "safe_set_local_optimizer_state").set_local_optimizer_state(param, optim_state_key, value)

