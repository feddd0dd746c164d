"""``engine.coalesce_grad_reduction()``: several backward passes, one gradient reduction.

Inside the block every ``engine.backward`` adds its gradients into this rank's local, unreduced
gradients and issues no collective; leaving the block reduces them once, bucket by bucket (group by group
at ZeRO-3), exactly as the boundary backward of a plain accumulation window would, and ``engine.step()``
then applies the update. At ZeRO stage 1 that is what a window whose earlier micro-steps are not at the
boundary does already; at stages 2 and 3, which otherwise reduce every backward, it trades the memory of
one full local gradient for ``N - 1`` fewer reduce-scatters per step (DeepSpeed's context of the same name).

The rules (DeepSpeed's): one block per optimizer step; ``engine.step()`` inside it and nesting it with
``engine.no_sync()`` are refused; ZeRO stage 0 (use ``no_sync()``), the pipeline engine, the deterministic
mode (it reduces each micro-step in a fixed tree) and ``optimizer_step_in_backward`` (it updates in every
backward) cannot coalesce. Inside the block ``safe_get_full_grad`` reads the local, unreduced gradient.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator


class GradContextMisuse(RuntimeError, AssertionError):
    """``engine.step()`` inside a gradient-reduction context, or two such contexts nested (an
    AssertionError too: DeepSpeed asserts there, and code written for it catches that)."""


class EngineCoalescing:
    """Mixed into ``DeepShardEngine``: the block and its checks. Reads ``self.strategy``, ``self._config``
    and the engine's ``_no_sync_depth``."""

    strategy: Any
    _config: Any
    _no_sync_depth: int
    pipeline_parallelism: bool

    _coalescing: bool = False

    @contextlib.contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; one reduction on leaving the block.

        Example::

            with engine.coalesce_grad_reduction():
                for i, (x, y) in enumerate(chunks):
                    engine.set_gradient_accumulation_boundary(i == len(chunks) - 1)
                    engine.backward(engine(x, y))
            engine.step()
        """
        self._check_can_coalesce()
        self._coalescing = True
        self.strategy.hold_gradients(True)
        try:
            yield
        except BaseException:
            # no reduction: another rank may not be here; what was held stays local and joins the next one
            self.strategy.hold_gradients(False)
            raise
        finally:
            self._coalescing = False
        self.strategy.reduce_held()

    def _check_can_coalesce(self) -> None:
        if self._coalescing or self._no_sync_depth > 0:
            raise GradContextMisuse("coalesce_grad_reduction() cannot be nested inside another no_sync() or "
                                    "coalesce_grad_reduction() block; leave the outer block first")
        if not self._config.managed_gradient_accumulation:
            raise GradContextMisuse("coalesce_grad_reduction() with managed_gradient_accumulation false: every "
                                    "step() is then a boundary of its own; set it true to coalesce")
        if self.pipeline_parallelism:
            raise NotImplementedError("coalesce_grad_reduction() is not supported under pipeline parallelism: "
                                      "the pipeline engine reduces once per train_batch() already")
        if self.strategy.stage == 0:
            raise NotImplementedError("coalesce_grad_reduction() needs ZeRO stage 1, 2 or 3; at stage 0 use "
                                      "engine.no_sync() for the backward passes before the last")
        if self._config.deterministic:
            raise NotImplementedError("coalesce_grad_reduction() in the deterministic mode: it reduces every "
                                      "micro-step into a fixed tree; turn one of them off")
        if self.strategy.steps_in_backward:
            raise NotImplementedError("coalesce_grad_reduction() with optimizer_step_in_backward: the update "
                                      "is applied in every backward; turn the option off to coalesce")
