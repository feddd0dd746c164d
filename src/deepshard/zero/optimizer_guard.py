"""The torch optimizer a ZeRO stage 1-3 engine took over is not a trap.

Those stages rebind the optimizer's param groups to this rank's shard pieces, so a direct ``step()`` on the
torch optimizer (the one passed to ``initialize``, or ``engine.optimizer.optimizer``) from a training loop
written for plain PyTorch would update nothing (the pieces get their gradients only inside the engine's
step). deepshard makes the mistake loud instead: that ``step()`` raises and says to call ``engine.step()``
(or ``engine.optimizer.step()``, the ZeRO optimizer's, ``zero_optimizer.py``); its ``zero_grad()`` clears the
accumulated gradients, as DeepSpeed's ZeRO optimizers do. The strategy itself steps through
``optim/whole_vectors.step_whole_vectors`` (the class's own ``step``, past the guard). At stage 0 the
optimizer holds the real parameters and is left as it is.
"""
from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch


class _Owner(Protocol):
    """The strategy that took the optimizer over: its stage (for the message) and its ``zero_grad``."""

    stage: int

    def zero_grad(self) -> None: ...


def guard(optimizer: torch.optim.Optimizer, strategy: _Owner) -> None:
    """Replace ``optimizer.step`` / ``zero_grad`` on this instance (see the module docstring)."""
    stage = strategy.stage
    owner = weakref.ref(strategy)

    def step(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"step() was called on the torch optimizer deepshard's engine took over; at ZeRO stage {stage} "
            "its parameters are this process's shards and only the engine can give them their gradients. "
            "Call engine.step() after engine.backward(loss) instead (it unscales, clips, updates and steps "
            "the LR scheduler at the gradient accumulation boundary), or engine.optimizer.step() for the ZeRO "
            "step alone")

    def zero_grad(set_to_none: bool = True) -> None:
        live = owner()
        if live is not None:
            live.zero_grad()

    setattr(optimizer, "step", step)  # on the instance: unguard() pops them again
    setattr(optimizer, "zero_grad", zero_grad)


def unguard(optimizer: torch.optim.Optimizer | None) -> None:
    """Give the optimizer back its own ``step`` and ``zero_grad`` (``engine.destroy``)."""
    if optimizer is None:
        return
    for name in ("step", "zero_grad"):
        optimizer.__dict__.pop(name, None)
