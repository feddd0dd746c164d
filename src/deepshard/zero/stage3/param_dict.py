"""Gathering a ZeRO-3 parameter that a forward reads from another module, undeclared.

A module's forward may use a parameter some other module owns (``F.linear(x, self.child.weight)``, a tied
weight read through a second module): deepshard's hooks gather, before a module's forward, only its own
parameters and those registered with ``zero.register_external_parameter``, so such a read would see the
released, empty parameter. As DeepSpeed does, every module's ``_parameters`` is a
:class:`ZeROOrderedDict`: ``module.weight`` reads ``module._parameters["weight"]``, and a read of a
released ZeRO-3 parameter while the model's forward runs gathers it at once and registers it as an
external parameter of the innermost running module (``Stage3Hooks.touched``), which gathers it before
each later forward and releases it after. Outside a forward (or inside a recompute) a read returns the
parameter as it is. Every rank runs the same forward, so every rank reads, and gathers, the same
parameters in the same order.

Modules attached after ``initialize`` are converted at the start of the next forward
(:func:`ensure_zero_ordered_dict`, DeepSpeed's name, as is ``deepspeed.runtime.zero.parameter_offload``'s
module path for both).
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any

import torch

from deepshard.zero.stage3.param_status import ZeroParamStatus


class ZeROOrderedDict(OrderedDict):
    """A module's ``_parameters``; reading a released ZeRO-3 parameter during forward gathers it (see the
    module docstring). ``parent_module``: the module it belongs to (DeepSpeed's signature)."""

    def __init__(self, parent_module: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parent_module = parent_module

    def __getitem__(self, key: str) -> Any:
        param = super().__getitem__(key)
        if param is not None and getattr(param, "ds_status", None) is ZeroParamStatus.NOT_AVAILABLE:
            hooks = _hooks_of(param)
            if hooks is not None:
                hooks.touched(param)
        return param

    def __reduce__(self) -> Any:
        """A copy (``copy.deepcopy(model)``, pickling) is a plain dict: the copy is not trained by the engine."""
        return (dict, (dict(self.items()),))


def _hooks_of(param: torch.nn.Parameter) -> Any:
    """The ZeRO-3 hooks of the strategy that trains ``param`` (found through its placement record)."""
    from deepshard.zero.strategy import owner_of

    strategy = owner_of(param)
    return getattr(strategy, "hooks", None)


def ensure_zero_ordered_dict(module: Any) -> None:
    """Make ``module._parameters`` a :class:`ZeROOrderedDict` (same contents) unless it is one already or
    is missing / not a dict; the first container replaced is kept as ``module._original_parameters``."""
    params = getattr(module, "_parameters", None)
    if isinstance(params, ZeROOrderedDict) or not isinstance(params, dict):
        return
    if not hasattr(module, "_original_parameters"):
        module._original_parameters = params
    converted = ZeROOrderedDict(parent_module=module)
    converted.update(params)
    module._parameters = converted


def watchable(root: torch.nn.Module) -> bool:
    """Whether reads can be watched: not in a model run through ``torch.compile``, whose graphs would trace
    the dict's reads (declare other modules' parameters with ``register_external_parameter`` there)."""
    if getattr(root, "_compiled_call_impl", None) is not None:
        return False
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is None or not any(isinstance(m, dynamo.eval_frame.OptimizedModule) for m in root.modules())


def install(root: torch.nn.Module) -> None:
    """Convert every module of ``root`` (at ``initialize``, and at each forward for modules attached since)."""
    for m in root.modules():
        ensure_zero_ordered_dict(m)


def uninstall(root: torch.nn.Module) -> None:
    """Plain dicts again (``engine.destroy()``): the model is no longer trained by the engine."""
    for m in root.modules():
        if isinstance(m.__dict__.get("_parameters"), ZeROOrderedDict):
            m._parameters = dict(m._parameters.items())
            m.__dict__.pop("_original_parameters", None)
