"""Build the optimizer and the lr scheduler that a DeepSpeed config's ``{"type", "params"}`` names.

Optimizers (the type is matched case-insensitively, as DeepSpeed does for its own names):

- ``Adam``: DeepSpeed's :class:`deepshard.optim.fused_adam.FusedAdam` (``deepspeed.ops.adam.FusedAdam``), as DeepSpeed builds: when its
  ``adam_w_mode`` is true (the default) a :class:`~deepshard.optim.fused_adam.FusedAdamW`, which is also a
  ``torch.optim.AdamW`` (the same update); when it is false a FusedAdam with the L2 penalty in the
  gradient (a ``torch.optim.Adam``). ``AdamW`` is always the FusedAdamW. With ``torch_adam: true`` they
  are torch's own ``AdamW`` / ``Adam``, as in DeepSpeed. ``weight_decay`` defaults to 0, as in
  DeepSpeed's FusedAdam (torch's AdamW would default to 0.01). DeepSpeed-only keys (``torch_adam``,
  ``set_grad_none``, ``fp32_optimizer_states``, ``bias_correction: true``) are dropped.
- ``Lamb`` -> :class:`deepshard.optim.Lamb` (FusedLamb's parameters and defaults).
- ``Lion`` -> :class:`deepshard.optim.Lion` with FusedLion's defaults (lr 1e-3, betas
  (0.9, 0.999)) where the config leaves them out.
- ``Adagrad``, ``SGD`` and any other name: the ``torch.optim`` class of that name (exact, then
  case-insensitive).
- ``OneBitAdam`` -> :class:`deepshard.compression.OneBitAdam` (1-bit compressed momentum after
  ``freeze_step``; ZeRO stage 0).
- ZeroOneAdam, OneBitLamb, MuAdam, MuAdamW, MuSGD (and Muon when torch has none): a ConfigError that
  names alternatives.

Schedulers: DeepSpeed's names (case-sensitive, as in DeepSpeed) from
:mod:`deepshard.optim.lr_schedules`, else ``torch.optim.lr_scheduler.<type>`` with the params
passed through. Every parameter name is checked against the constructor's signature first, so a
typo is an error that lists the accepted names instead of a TypeError deep inside torch.

Every refusal here is a :class:`~deepshard.config.ConfigError` (a ``ValueError``): a mistake in the config,
the same on every rank, which the launcher prints once, in one line, without a traceback.
"""
from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable
from typing import Any

import torch

from deepshard.config.base import ConfigError
from deepshard.optim.fused_adam import FusedAdam, FusedAdamW
from deepshard.optim.lamb import Lamb
from deepshard.optim.lion import Lion
from deepshard.optim.lr_schedules import (VALID_LR_SCHEDULES, LRRangeTest, LRSchedulerLike,
                                          OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR)
from deepshard.utils.logging import logger

__all__ = ["build_optimizer", "build_scheduler", "DEEPSPEED_OPTIMIZERS"]

# DeepSpeed's own optimizer names (lower case), as its config matches them.
DEEPSPEED_OPTIMIZERS: list[str] = ["adam", "adamw", "lamb", "onebitadam", "zerooneadam",
                                   "onebitlamb", "adagrad", "lion", "muadam", "muadamw",
                                   "musgd", "muon"]

_UNSUPPORTED: dict[str, tuple[str, str]] = {
    "zerooneadam": ("ZeroOneAdam", "'OneBitAdam' (1-bit compressed momentum, ZeRO stage 0) or 'Adam' "
                                   "(deepshard has no 0/1 Adam)"),
    "onebitlamb": ("OneBitLamb", "'OneBitAdam' (1-bit compressed momentum, ZeRO stage 0) or 'Lamb' "
                                 "(deepshard has no 1-bit LAMB)"),
    "muadam": ("MuAdam", "'Adam', or build mup.MuAdam yourself and pass it as "
                         "initialize(optimizer=...)"),
    "muadamw": ("MuAdamW", "'AdamW', or build mup.MuAdamW yourself and pass it as "
                           "initialize(optimizer=...)"),
    "musgd": ("MuSGD", "'SGD', or build mup.MuSGD yourself and pass it as "
                       "initialize(optimizer=...)"),
    "muon": ("Muon", "'AdamW', or a torch version that has torch.optim.Muon"),
}

# Keys DeepSpeed's fused/CPU kernels accept that the torch / deepshard classes do not. Value:
# the only setting deepshard can honour (None: any value is fine to drop).
_DEEPSPEED_ONLY_KEYS: dict[str, dict[str, Any]] = {
    "adam": {"torch_adam": None, "adam_w_mode": None, "set_grad_none": None,
             "fp32_optimizer_states": None, "bias_correction": True},
    "lion": {"set_grad_none": None, "fp32_optimizer_states": None},
    "adagrad": {"fp32_optimizer_states": None},
}
_DEEPSPEED_ONLY_KEYS["adamw"] = _DEEPSPEED_ONLY_KEYS["adam"]

_FUSED_LION_DEFAULTS: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999)}

_SCHEDULERS: dict[str, type] = {"LRRangeTest": LRRangeTest, "OneCycle": OneCycle,
                                "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
                                "WarmupCosineLR": WarmupCosineLR}


def build_optimizer(type_name: str, params: dict[str, Any] | None,
                    model_params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]
                    ) -> torch.optim.Optimizer:
    """Build the optimizer a DeepSpeed config's ``optimizer`` section names.

    Args:
        type_name: ``optimizer.type`` ("Adam", "AdamW", "Lamb", "Lion", "SGD", any torch.optim
            class name ...), matched case-insensitively.
        params: ``optimizer.params`` (may be None); not modified.
        model_params: parameters or parameter-group dicts, as for any torch optimizer.

    Raises:
        ConfigError: unsupported or unknown type (with the closest names), a parameter the
            optimizer does not accept (with the accepted ones), ``max_grad_norm``, or an
            unresolved ``"auto"``.
    """
    if not isinstance(type_name, str) or not type_name:
        raise ConfigError(f"optimizer.type must be a non-empty string, got {type_name!r}")
    params = dict(params or {})
    _reject_auto(params, "optimizer")
    if "max_grad_norm" in params:
        raise ConfigError("optimizer.params.max_grad_norm is not supported (as in DeepSpeed); "
                         "use the top-level config key 'gradient_clipping' instead")
    key = type_name.lower()
    if key in _UNSUPPORTED and not (key == "muon" and hasattr(torch.optim, "Muon")):
        label, alternatives = _UNSUPPORTED[key]
        raise ConfigError(f"optimizer type '{type_name}' (DeepSpeed's {label}) is not supported "
                         f"by deepshard; use {alternatives}")
    adam_w_mode = None
    if key in ("adam", "adamw"):
        cls = _adam_class(key, params)
        if issubclass(cls, FusedAdam) and not issubclass(cls, torch.optim.AdamW):
            adam_w_mode = False
    elif key == "lamb":
        cls = Lamb
    elif key == "onebitadam":
        from deepshard.compression.onebit_adam import OneBitAdam

        cls = OneBitAdam
    elif key == "lion":
        cls = Lion
        params = {**_FUSED_LION_DEFAULTS, **params}
    else:
        cls = _torch_optimizer_class(type_name)
    dropped = _DEEPSPEED_ONLY_KEYS.get(key, {})
    params = _drop_deepspeed_only(type_name, params, dropped)
    if adam_w_mode is not None:  # FusedAdam with the L2 penalty: the one setting the class needs told
        params["adam_w_mode"] = adam_w_mode
    params = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}
    _check_params(cls, f"optimizer '{type_name}'", params, skip=("params",),
                  also_accepted=list(dropped), prefix="optimizer.params")
    return cls(model_params, **params)


def build_scheduler(type_name: str, params: dict[str, Any] | None,
                    optimizer: torch.optim.Optimizer) -> LRSchedulerLike:
    """Build the lr scheduler a DeepSpeed config's ``scheduler`` section names.

    Args:
        type_name: ``scheduler.type``: one of ``VALID_LR_SCHEDULES`` (case-sensitive, as in
            DeepSpeed) or a ``torch.optim.lr_scheduler`` class name.
        params: ``scheduler.params`` (may be None); passed through as keyword arguments.
        optimizer: the optimizer whose lrs the schedule drives.

    Raises:
        ConfigError: unknown type (listing VALID_LR_SCHEDULES and the closest name), a parameter
            the scheduler does not accept or a missing required one, or an unresolved "auto".
    """
    if not isinstance(type_name, str) or not type_name:
        raise ConfigError(f"scheduler.type must be a non-empty string, got {type_name!r}")
    params = dict(params or {})
    _reject_auto(params, "scheduler")
    cls = _SCHEDULERS.get(type_name) or _torch_scheduler_class(type_name)
    _check_params(cls, f"scheduler '{type_name}'", params, skip=("optimizer",),
                  prefix="scheduler.params")
    return cls(optimizer, **params)


def _reject_auto(params: dict[str, Any], section: str) -> None:
    """An ``"auto"`` left in the params means the integration that fills it did not run."""
    for name, value in params.items():
        if isinstance(value, str) and value == "auto":
            raise ConfigError(f"{section}.params.{name} is \"auto\"; \"auto\" is resolved by the "
                             "HF Trainer / Accelerate integration, so give a value when using "
                             "the config directly")


def _adam_class(key: str, params: dict[str, Any]) -> type[torch.optim.Optimizer]:
    """AdamW (decoupled weight decay) or Adam (L2), following DeepSpeed's ``adam_w_mode``: DeepSpeed's
    FusedAdam classes, or torch's with ``torch_adam``."""
    adam_w_mode = params.get("adam_w_mode", True)
    params.setdefault("weight_decay", 0.0)
    if key == "adamw" and not adam_w_mode:
        logger.warning("optimizer 'AdamW' ignores adam_w_mode=false (as DeepSpeed does); use "
                       "type 'Adam' with adam_w_mode false for an L2 penalty")
    decoupled = key == "adamw" or adam_w_mode
    if params.get("torch_adam"):
        return torch.optim.AdamW if decoupled else torch.optim.Adam
    return FusedAdamW if decoupled else FusedAdam


def _drop_deepspeed_only(type_name: str, params: dict[str, Any],
                         dropped: dict[str, Any]) -> dict[str, Any]:
    """Remove the DeepSpeed-kernel-only keys, refusing settings deepshard cannot honour."""
    kept = {}
    for name, value in params.items():
        if name not in dropped:
            kept[name] = value
            continue
        required = dropped[name]
        if required is not None and value != required:
            raise ConfigError(f"optimizer '{type_name}': {name}={value!r} is not supported; "
                             f"deepshard always uses {name}={required!r} (remove the key)")
        logger.debug("optimizer '%s': dropping DeepSpeed-only param %s=%r", type_name, name,
                     value)
    return kept


def _torch_optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """Every concrete optimizer class that ``torch.optim`` exports, by name."""
    found = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if (inspect.isclass(obj) and issubclass(obj, torch.optim.Optimizer)
                and obj is not torch.optim.Optimizer):
            found[name] = obj
    return found


def _torch_optimizer_class(type_name: str) -> type[torch.optim.Optimizer]:
    """``torch.optim.<type_name>`` (exact name first, then case-insensitive)."""
    classes = _torch_optimizer_classes()
    if type_name in classes:
        return classes[type_name]
    by_lower = {name.lower(): cls for name, cls in classes.items()}
    if type_name.lower() in by_lower:
        return by_lower[type_name.lower()]
    valid = ["Adam", "AdamW", "Lamb", "Lion"] + sorted(set(classes) - {"Adam", "AdamW"})
    raise ConfigError(f"unknown optimizer type {_quote_with_hint(type_name, valid)}. "
                     f"Valid types: {', '.join(valid)} (case-insensitive), or pass your own "
                     "optimizer as initialize(optimizer=...)")


def _torch_scheduler_class(type_name: str) -> type:
    """``torch.optim.lr_scheduler.<type_name>`` or a ConfigError with the closest name."""
    module = torch.optim.lr_scheduler
    base_types = (module.LRScheduler, module.ReduceLROnPlateau)
    torch_names = sorted(
        name for name in dir(module)
        if inspect.isclass(getattr(module, name)) and issubclass(getattr(module, name), base_types)
        and name not in ("LRScheduler", "_LRScheduler"))
    if type_name in torch_names:
        return getattr(module, type_name)
    named = _quote_with_hint(type_name, VALID_LR_SCHEDULES + torch_names)
    raise ConfigError(f"unknown scheduler type {named}. DeepSpeed schedules "
                     f"(VALID_LR_SCHEDULES): {', '.join(VALID_LR_SCHEDULES)}; or a "
                     f"torch.optim.lr_scheduler class: {', '.join(torch_names)} "
                     "(names are case-sensitive)")


def _did_you_mean(name: str, candidates: list[str]) -> str:
    """"did you mean 'X'?" for a case-insensitive exact or close match, else ""."""
    for candidate in candidates:
        if candidate.lower() == name.lower():
            return f"did you mean '{candidate}'?"
    by_lower = {c.lower(): c for c in candidates}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=0.6)
    if not close:  # a prefix match catches 'lr_rate' -> 'lr', which difflib scores too low
        close = [c for c in by_lower if len(c) >= 2 and name.lower().startswith(c)][:3]
    if not close:
        return ""
    return "did you mean " + " or ".join(f"'{by_lower[c]}'" for c in close) + "?"


def _quote_with_hint(name: str, candidates: list[str]) -> str:
    """``'name'`` followed by ``(did you mean 'x'?)`` when a candidate is close."""
    hint = _did_you_mean(name, candidates)
    return f"'{name}' ({hint})" if hint else f"'{name}'"


def _check_params(cls: type, label: str, params: dict[str, Any], skip: tuple[str, ...],
                  prefix: str, also_accepted: list[str] | None = None) -> None:
    """Raise a ConfigError for a key ``cls`` does not take, or a required one that is missing."""
    signature = inspect.signature(cls)
    fields = [p for p in signature.parameters.values() if p.name not in skip]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in fields):
        return
    named = [p for p in fields if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    accepted = list(dict.fromkeys([p.name for p in named] + list(also_accepted or [])))
    unknown = [name for name in params if name not in accepted]
    if unknown:
        described = ", ".join(_quote_with_hint(name, accepted) for name in unknown)
        raise ConfigError(f"{label} ({cls.__module__}.{cls.__qualname__}) does not accept "
                         f"{prefix} {described}; accepted: {', '.join(accepted)}")
    missing = [p.name for p in named
               if p.default is inspect.Parameter.empty and p.name not in params]
    if missing:
        raise ConfigError(f"{label} requires {prefix} {', '.join(repr(n) for n in missing)}; "
                         f"accepted: {', '.join(accepted)}")
