"""The strategy a destroyed engine holds: every call says the engine was destroyed and what to do.

``engine.destroy()`` releases the real strategy (hooks removed, files closed, parameters no longer owned)
and puts a :class:`ReleasedStrategy` in its place, so ``engine.strategy`` is never None: code that reads it
needs no None check, and a late call fails with a message instead of an ``AttributeError`` on None.
"""
from __future__ import annotations

from typing import NoReturn

import torch

from deepshard.shard_state import FullState, ShardState
from deepshard.zero.strategy import ZeroStrategy


class EngineDestroyedError(RuntimeError):
    """A call on an engine after ``engine.destroy()``."""


class ReleasedStrategy(ZeroStrategy):
    """Stands in for the strategy of a destroyed engine (see the module docstring)."""

    def __init__(self, released: ZeroStrategy) -> None:  # noqa: D107 - no claim on the module's parameters
        self.stage = released.stage
        self.capabilities = released.capabilities
        self.module = released.module
        self.optimizer = None
        self.ctx = released.ctx

    def _gone(self, what: str) -> NoReturn:
        raise EngineDestroyedError(f"{what}: this engine was destroyed (engine.destroy() released its ZeRO stage "
                                   f"{self.stage} state); build a new engine with deepshard.initialize")

    def begin_backward(self, reduce: bool) -> None:
        self._gone("engine.backward()")

    def end_backward(self) -> None:
        self._gone("engine.backward() / engine.step()")

    def global_grad_norm(self, loss_scale: float) -> float:
        self._gone("the gradient norm")

    def step(self, grad_multiplier: float) -> None:
        self._gone("engine.step()")

    def zero_grad(self) -> None:
        self._gone("engine.zero_grad()")

    def release(self) -> None:
        """Nothing is held any more: a second ``destroy()`` is a no-op."""

    def shard_state(self, exclude_frozen: bool = False) -> ShardState | None:
        self._gone("engine.save_checkpoint()")

    def load_state(self, full: FullState, load_optimizer_states: bool) -> None:
        self._gone("engine.load_checkpoint()")

    def consolidated_state_dict(self, rank: int, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
        self._gone("the 16-bit state dict")

    def memory_report(self) -> dict[str, int]:
        self._gone("engine.memory_report()")
