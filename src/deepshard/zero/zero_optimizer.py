"""``engine.optimizer`` at ZeRO stages 1-3: the engine's ZeRO optimizer, DeepSpeed's wrapper surface.

DeepSpeed hands out its ZeRO optimizer there (``DeepSpeedZeroOptimizer`` at stages 1/2,
``DeepSpeedZeroOptimizer_Stage3`` at stage 3, both ``ZeROOptimizer``s) and the user's torch optimizer is its
``.optimizer``; code written for DeepSpeed reads that surface (``engine.optimizer.optimizer.state``,
``isinstance(engine.optimizer, ZeROOptimizer)``, ``needs_scaler()``, ``overflow``, ``_global_grad_norm``,
``parameter_offload``). deepshard's engine builds one of the classes below over itself, so those names do
the real thing on the engine's state:

- ``optimizer``: the torch optimizer (its param groups hold this rank's shard pieces; its own ``step`` stays
  guarded, ``optimizer_guard.py``); ``param_groups``, ``state``, ``defaults`` are its very objects (the LR
  scheduler and ``engine.get_lr()`` see the same groups); ``state_dict()`` / ``load_state_dict()`` are its.
- ``step()``: the ZeRO step of the current gradients (norm, fp16 overflow skip with the loss scale's
  back-off, clipping, the update, the new values published to the module); not the LR scheduler nor the
  engine's counters, which ``engine.step()`` adds, as in DeepSpeed.
- ``zero_grad()``, ``backward(loss)``, ``loss_scale`` / ``cur_scale`` / ``dynamic_loss_scale`` / ``overflow``
  (the engine's loss scaler and last step), ``_global_grad_norm``, ``needs_scaler()``, ``_get_norm_groups()``.

Other names do not fall through to the torch optimizer (DeepSpeed's wrappers do not either): code that
probes ``hasattr(engine.optimizer, ...)`` for a DeepSpeed internal gets DeepSpeed's answer, and the error
names ``engine.optimizer.optimizer`` for what the torch optimizer has. Only the engine builds these objects
(``build``); constructing one by hand is refused, as it was before they existed.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from deepshard.zero.stage3.grad_views import Stage3GradViews

__all__ = ["DeepSpeedOptimizer", "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "ZeROOptimizer",
           "build"]


class DeepSpeedOptimizer:
    """DeepSpeed's base of optimizer wrappers (``deepspeed.runtime.base_optimizer.DeepSpeedOptimizer``)."""

    replacement = "deepshard's engine does this for the torch optimizer itself"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} is DeepSpeed's optimizer wrapper; deepshard does not let "
                                  f"you build one: {self.replacement}. Build the engine with deepshard.initialize "
                                  "instead")


class ZeROOptimizer(DeepSpeedOptimizer):
    """The engine's ZeRO optimizer (DeepSpeed's ``ZeROOptimizer``): see the module docstring."""

    replacement = ("ZeRO partitions the optimizer state inside the engine (zero_optimization.stage); at stages 1-3 "
                   "engine.optimizer is this object, built by the engine, and the torch optimizer is its .optimizer")

    _engine: Any
    optimizer: torch.optim.Optimizer

    @classmethod
    def _over(cls, engine: Any, optimizer: torch.optim.Optimizer) -> "ZeROOptimizer":
        """The object for ``engine`` (the engine's own call, past the refusing ``__init__``)."""
        self = object.__new__(cls)
        self.__dict__.update(_engine=engine, optimizer=optimizer)
        return self

    # ------------------------------------------------------------------------ the torch optimizer's
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        """The torch optimizer's state dict (of this rank's shard pieces); whole checkpoints are
        ``engine.save_checkpoint``'s."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``state_dict()`` returned (on the same layout)."""
        self.optimizer.load_state_dict(state_dict)

    # ------------------------------------------------------------------------------- the ZeRO step
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """The ZeRO step of the current gradients: the global norm, on an fp16 overflow the update skipped
        (the gradients cleared, the loss scale backed off), else unscale and clip, the update, the new values
        published to the module. The LR scheduler and the engine's counters are ``engine.step()``'s."""
        if closure is not None:
            raise ValueError("engine.optimizer.step(closure): ZeRO optimizers take no closure (DeepSpeed's do not "
                             "either); compute the loss, call engine.backward(loss), then step()")
        engine = self._engine
        engine.strategy.end_backward()  # a reduction still pending (engine.scale(loss).backward()) completes
        if not engine.runner.update(engine):
            engine.strategy.zero_grad()  # as DeepSpeed's: an overflowed step leaves no gradients behind

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the accumulated gradients (what a cleared gradient reads as is the stage's)."""
        self._engine.strategy.zero_grad()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward of ``loss`` times the loss scale, gradients reduced at the accumulation boundary: the
        engine's backward without its division by the accumulation steps (DeepSpeed's wrapper's)."""
        self._engine.backward(loss, retain_graph=retain_graph, scale_wrt_gas=False)

    # ----------------------------------------------------------------------------- loss scale, norm
    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale (1.0 without fp16); settable, as DeepSpeed's."""
        return float(self._engine.loss_scaler.scale)

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        if not value > 0:
            raise ValueError(f"loss_scale must be > 0, got {value!r}")
        self._engine.loss_scaler.scale = float(value)

    cur_scale = loss_scale

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether the loss scale adapts to overflows (fp16 with ``loss_scale: 0``)."""
        return bool(self._engine.loss_scaler.dynamic)

    @property
    def overflow(self) -> bool:
        """Whether the last step's gradients were not finite (the update was skipped, unless applied in
        backward); False before the first step."""
        norm = self._engine.state.grad_norm
        return norm is not None and not math.isfinite(norm)

    @property
    def _global_grad_norm(self) -> float | None:
        """The last step's global gradient norm before clipping (``engine.get_global_grad_norm()``)."""
        return self._engine.state.grad_norm

    def needs_scaler(self) -> bool:
        """Whether backward must scale the loss (``engine.scale(loss)``): True only with a dynamic fp16 loss
        scale, as DeepSpeed answers; bf16 and fp32 need none."""
        return self.dynamic_loss_scale

    def _get_norm_groups(self) -> list[torch.Tensor]:
        """The norm of the current (loss-scaled) gradients, as DeepSpeed's list of group norms whose
        ``vector_norm(stack(...))`` is the global norm. deepshard computes the global norm over all groups at
        once (exactly, ``grad_norm.py``), so the list has one entry. A collective: every rank calls it."""
        engine = self._engine
        engine.strategy.end_backward()
        norm = engine.strategy.model_grad_norm(1.0)
        return [torch.tensor(norm, dtype=torch.float32, device=engine.device)]

    @property
    def _partitions(self) -> list[torch.Tensor]:
        """The fp32 tensors the torch optimizer updates: this rank's shard pieces, group by group (the keys
        of ``optimizer.state``)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    # ---------------------------------------------------------------------------------- the rest
    def _refusal(self, name: str) -> str | None:
        """Why one of this class's names refuses to answer now (its property raised AttributeError, which
        Python hands to ``__getattr__``); None when it does not refuse."""
        return None

    def __getattr__(self, name: str) -> Any:
        refusal = self._refusal(name)
        if refusal is not None:  # one of this class's names refused to answer, saying why
            raise AttributeError(refusal)
        if hasattr(type(self), name):  # one of this class's names could not answer: the engine is gone
            raise AttributeError(f"engine.optimizer.{name}: this engine was destroyed (engine.destroy() released its "
                                 "ZeRO state); build a new engine with deepshard.initialize")
        raise AttributeError(f"'{type(self).__name__}' (engine.optimizer, deepshard's ZeRO optimizer) has no attribute "
                             f"'{name}'; the torch optimizer is engine.optimizer.optimizer "
                             f"({type(self.__dict__.get('optimizer')).__name__})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(optimizer={self.optimizer!r})"


class DeepSpeedZeroOptimizer(ZeROOptimizer):
    """``engine.optimizer`` at ZeRO stages 1 and 2 (DeepSpeed's ``stage_1_and_2.DeepSpeedZeroOptimizer``)."""

    @property
    def single_partition_of_fp32_groups(self) -> list[torch.Tensor]:
        """This rank's fp32 partition: the tensors the torch optimizer updates, the keys of its state.
        DeepSpeed keeps one flat tensor per param group; deepshard one per parameter piece, in group order."""
        return self._partitions

    @property
    def bit16_groups_flat(self) -> list[torch.Tensor]:
        """The flat buffer the module's trainable parameters are views of, in the parameters' dtype (fp32, fp16
        or bf16) on the engine's device: writing into it changes the parameters. DeepSpeed keeps one such buffer
        per param group; deepshard keeps one for all param groups (parameters in launch order, each bucket
        padded to a multiple of the data-parallel size), so the list has one entry: it is DeepSpeed's list
        exactly when there is one param group. With several it is refused (an AttributeError saying why),
        since code written for DeepSpeed pairs the list with ``param_groups`` and would read every group's
        parameters as the first group's."""
        if len(self.optimizer.param_groups) != 1:  # __getattr__ raises with _refusal's text
            raise AttributeError("bit16_groups_flat")
        return self._engine.strategy.flat_buffers()

    def _refusal(self, name: str) -> str | None:
        if name != "bit16_groups_flat":
            return None
        groups = len(self.optimizer.param_groups)
        if groups == 1:
            return None
        return (f"engine.optimizer.bit16_groups_flat is DeepSpeed's one flat buffer per param group; deepshard keeps "
                f"one buffer for all {groups} param groups, so there is no per-group list to give. Read each "
                "parameter's values through the parameters (they are views of that buffer), or train with one "
                "param group")


class DeepSpeedZeroOptimizer_Stage3(ZeROOptimizer):  # noqa: N801 - DeepSpeed's name
    """``engine.optimizer`` at ZeRO stage 3 (DeepSpeed's ``stage3.DeepSpeedZeroOptimizer_Stage3``)."""

    @property
    def fp32_partitioned_groups_flat(self) -> list[torch.Tensor]:
        """This rank's fp32 partition: the tensors the torch optimizer updates, the keys of its state.
        DeepSpeed keeps one flat tensor per sub-group; deepshard one per parameter piece, in group order."""
        return self._partitions

    def get_fp32_grad_partitions(self) -> dict[int, dict[int, torch.Tensor]]:
        """``{param group: {param index: this rank's fp32 part of the parameter's reduced gradient}}`` in
        DeepSpeed's per-parameter split (``ceil(numel / world)`` elements, the last rank's zero-padded), as the
        gradients stand after the last backward (accumulated until a step or ``zero_grad()`` clears them).
        Views of the engine's gradient store where deepshard's partition of a parameter is DeepSpeed's (a
        parameter alone in its ZeRO-3 group); assembled across ranks where it is not, so every data-parallel rank
        calls it together (``zero/stage3/grad_views.py``)."""
        parts = Stage3GradViews(self._engine.strategy).partitions(True)
        return {gi: dict(enumerate(group)) for gi, group in parts.items()}

    @property
    def averaged_gradients(self) -> dict[int, list[torch.Tensor]]:
        """``{param group: [this rank's part of each parameter's reduced gradient]}``, in the gradients' dtype,
        in DeepSpeed's per-parameter split (see :meth:`get_fp32_grad_partitions`)."""
        return Stage3GradViews(self._engine.strategy).partitions(False)

    @property
    def parameter_offload(self) -> Any:
        """The ZeRO-3 hook object generation code takes off and puts back (``stage3/hook_surface.py``)."""
        surface = getattr(self._engine.strategy, "hook_surface", None)
        if surface is None:  # answered by __getattr__: the engine was destroyed
            raise AttributeError("parameter_offload")
        return surface


def build(engine: Any, optimizer: torch.optim.Optimizer | None, stage: int) -> Any:
    """What ``engine.optimizer`` is: ``optimizer`` itself at stage 0 or without one, else the stage's ZeRO
    optimizer over ``engine``."""
    if optimizer is None or stage == 0:
        return optimizer
    cls = DeepSpeedZeroOptimizer_Stage3 if stage == 3 else DeepSpeedZeroOptimizer
    return cls._over(engine, optimizer)
