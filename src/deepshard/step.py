"""The training counters and the one optimizer-step path, shared by ``DeepShardEngine`` and the pipeline
engine.

At an accumulation boundary a step is, in this order: the global gradient norm (summed over the
data-parallel group, then the model-parallel group; inf/nan means an fp16 overflow, identical on every
rank) -> skip the update on overflow (the loss scale backs off) -> otherwise clip (one multiplier folded
into the unscaling) -> the optimizer update (the strategy's) -> the loss scale's growth -> the LR
schedule -> zero the gradients -> the counters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from deepshard.precision import LossScaler
from deepshard.utils.logging import logger
from deepshard.zero.strategy import ZeroStrategy


@dataclass
class TrainState:
    """The counters a checkpoint restores and the monitors report."""

    global_steps: int = 0
    global_samples: int = 0
    micro_steps: int = 0
    skipped_steps: int = 0
    grad_norm: Optional[float] = None
    step_applied: bool = False


def clip_multiplier(norm: float, clip: float) -> float:
    """The factor that brings the gradient norm down to ``clip`` (1.0 when it is already below, or when
    clipping is off: ``clip <= 0``)."""
    if clip <= 0:
        return 1.0
    coef = clip / (norm + 1e-6)
    return coef if coef < 1.0 else 1.0


def update_step(strategy: ZeroStrategy, state: TrainState, loss_scaler: LossScaler, clip: float, rank: int) -> bool:
    """The ZeRO optimizer's step (``engine.optimizer.step()``): the norm (kept as the last step's), on
    overflow the update skipped and the loss scale backed off, else clip and update; returns whether the
    update was applied. The LR schedule, the gradients' clearing and the counters are ``optimizer_step``'s."""
    scale = loss_scaler.scale
    norm = strategy.model_grad_norm(scale)
    state.grad_norm = norm
    state.step_applied = False
    finite = math.isfinite(norm)
    if strategy.optimizer is not None:  # DeepSpeed's optimizers say it; code holding the torch optimizer reads it
        setattr(strategy.optimizer, "overflow", not finite)
    if not finite and strategy.steps_in_backward:
        logger.warning("rank %d: step %d: gradient norm is %s; with optimizer_step_in_backward the update "
                       "was already applied during backward and cannot be skipped", rank, state.global_steps, norm)
    if not finite and not strategy.steps_in_backward:
        loss_scaler.update(True)
        logger.warning("rank %d: step %d skipped: gradient overflow (norm %s); loss scale %g -> %g", rank,
                       state.global_steps, norm, scale, loss_scaler.scale)
        return False
    strategy.step(clip_multiplier(norm, clip) / scale)
    loss_scaler.update(False)
    state.step_applied = True
    return True


def optimizer_step(strategy: ZeroStrategy, state: TrainState, loss_scaler: LossScaler, clip: float,
                   lr_scheduler: Any, samples: int, rank: int, lr_kwargs: Optional[dict[str, Any]] = None) -> bool:
    """Run one optimizer step at the accumulation boundary (``update_step``, then the LR schedule, the
    gradients cleared, the counters); returns whether the update was applied."""
    if update_step(strategy, state, loss_scaler, clip, rank):
        if lr_scheduler is not None:
            lr_scheduler.step(**(lr_kwargs or {}))
    else:
        state.skipped_steps += 1
    strategy.zero_grad()
    state.global_steps += 1
    state.global_samples += samples
    return state.step_applied


class StepRunner:
    """The one path from a loss to an applied update, held by both engines (``engine.runner``): the
    loss divided over the accumulation window and multiplied by the fp16 loss scale for backward, the
    reduce-once call of the strategy, the optimizer step at the boundary (``optimizer_step``) with its
    autotuning probe, and the wrap-up (micro-step counter, tools, the step's report)."""

    def __init__(self, state: TrainState, loss_scaler: LossScaler, config: Any, rank: int) -> None:
        from deepshard.autotuning.probe import AutotuneProbe

        self.state = state
        self.loss_scaler = loss_scaler
        self.config = config
        self.rank = rank
        self.autotune = AutotuneProbe.from_env()  # set only inside a `deepshard --autotuning` trial

    @property
    def clip(self) -> float:
        """The config's ``gradient_clipping`` (0: no clipping)."""
        return float(self.config.gradient_clipping or 0.0)

    def for_backward(self, loss: Any, divide: bool = True) -> tuple[Any, Any]:
        """``(loss / accumulation steps, that times the loss scale)``: what backward starts from. In the
        deterministic mode backward starts from the undivided loss (each micro-batch's gradient enters the
        canonical sum whole, and the strategy divides the sum once: ``zero/canonical.py``); the divided
        loss is still what is returned."""
        steps = int(self.config.gradient_accumulation_steps)
        if divide and steps > 1:
            divided = loss / steps
            if not self.config.deterministic:
                loss = divided
        else:
            divided = loss
        scale = self.loss_scaler.scale
        return divided, (loss * scale if scale != 1.0 else loss)

    @staticmethod
    def reduce_once(strategy: ZeroStrategy) -> None:
        """Reduce the locally accumulated gradients now (a pipeline's batch end): one reduction."""
        strategy.begin_backward(True)
        strategy.end_backward()

    def boundary_step(self, engine: Any, lr_kwargs: Optional[dict[str, Any]] = None) -> bool:
        """The optimizer step at an accumulation boundary (clipping, overflow skip, LR schedule)."""
        applied = optimizer_step(engine.strategy, self.state, self.loss_scaler, self.clip, engine.lr_scheduler,
                                 int(self.config.train_batch_size), self.rank, lr_kwargs)
        if self.autotune is not None:  # an autotuning trial: measure, and end the run at its last step
            self.autotune.after_step(engine)
        return applied

    def update(self, engine: Any) -> bool:
        """The ZeRO optimizer's step alone (``update_step``): ``engine.optimizer.step()``."""
        return update_step(engine.strategy, self.state, self.loss_scaler, self.clip, self.rank)

    def finish(self, engine: Any, micro_steps: int, boundary: bool) -> None:
        """After a step call: count the micro-steps, let the tools see it, report a boundary."""
        self.state.micro_steps += micro_steps
        engine.tools.after_step(engine, boundary)
        if boundary:
            engine._report_step()
