"""``engine.optimizer.parameter_offload``: the ZeRO-3 hook object generation code removes and restores.

In DeepSpeed the ZeRO-3 optimizer holds a ``DeepSpeedZeRoOffload`` (the name is historical: it is the
object that owns the module hooks gathering and releasing parameters). Code that generates with a
ZeRO-3 model gathers everything once and takes those hooks off for the duration, so that the many
small forwards of ``generate`` do not gather and release each module again; TRL's
``unwrap_model_for_generation`` is the common case::

    with deepspeed.zero.GatheredParameters(engine.parameters()):
        remove_hooks(engine)   # p.ds_active_sub_modules.clear(); h.remove() for h in forward_hooks / backward_hooks
        ...generate...
        add_hooks(engine)      # parameter_offload._register_deepspeed_module(parameter_offload.module)

:class:`HookSurface` answers those names over deepshard's :class:`~deepshard.zero.stage3.hooks.Stage3Hooks`:
``forward_hooks`` are its module hook handles (removing them removes deepshard's gathering hooks; the
backward gathers are registered by the forward hooks, so ``backward_hooks`` is empty), and
``_register_deepspeed_module`` (``_register_hooks_recursively`` before DeepSpeed 0.16.4) installs them
again. Gradient reduction is not a module hook and is never removed. The stage-3 strategy holds it
(``strategy.hook_surface``, None once the engine is destroyed) and the engine's ZeRO-3 optimizer answers it
as ``parameter_offload`` (``zero/zero_optimizer.py``), as DeepSpeed's ZeRO-3 optimizer holds its own.
"""
from __future__ import annotations

from typing import Any

import torch

from deepshard.zero.stage3.hooks import Stage3Hooks


class HookSurface:
    """DeepSpeed's ``DeepSpeedZeRoOffload`` names over deepshard's ZeRO-3 hooks (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, hooks: Stage3Hooks, release_all: Any) -> None:
        self.module = module
        self._hooks = hooks
        self._release_all = release_all
        self.forward_hooks: list[Any] = list(hooks.handles)
        self.backward_hooks: list[Any] = []

    def _register_deepspeed_module(self, module: torch.nn.Module, count: Any = None) -> None:
        """(Re-)install the gathering hooks on the whole model (``module`` must be the engine's module)."""
        if module is not self.module:
            raise ValueError(f"parameter_offload._register_deepspeed_module: deepshard installs ZeRO-3 hooks for the "
                             f"whole model at once, so pass the engine's module ({type(self.module).__name__}), not "
                             f"{type(module).__name__}")
        self._hooks.install()
        self.forward_hooks = list(self._hooks.handles)
        self.backward_hooks = []

    _register_hooks_recursively = _register_deepspeed_module  # DeepSpeed < 0.16.4's name

    def _remove_module_hooks(self) -> None:
        """Take the gathering hooks off (DeepSpeed's name)."""
        self._hooks.remove()
        self.forward_hooks, self.backward_hooks = [], []

    def partition_all_parameters(self) -> None:
        """Release every gathered group nothing is using (persistent ones stay)."""
        self._release_all()
