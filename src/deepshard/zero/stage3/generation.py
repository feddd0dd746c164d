"""``unwrap_model_for_generation``: DeepSpeed's context manager (``deepspeed.runtime.zero``) that gathers a
ZeRO-3 model's parameters once and takes its gathering hooks off for the block, so the many small forwards
of ``generate`` run on whole weights without gathering and releasing each module again; the hooks are put
back (and the parameters released) when the block ends, so training continues as before."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from deepshard.zero.stage3.gather import GatheredParameters


@contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """Yield ``model`` (an engine) with every parameter gathered and, under ZeRO-3, its gathering hooks
    removed (``engine.optimizer.parameter_offload.forward_hooks`` is empty inside the block); other stages
    have no hooks to remove. Every rank must enter it (the gather is a collective)."""
    # the strategy's, which engine.optimizer.parameter_offload answers: there with or without an optimizer
    surface = getattr(getattr(model, "strategy", None), "hook_surface", None)
    with GatheredParameters(list(model.parameters())):
        if surface is None:
            yield model
            return
        for hook in surface.forward_hooks + surface.backward_hooks:
            hook.remove()
        surface.forward_hooks, surface.backward_hooks = [], []
        try:
            yield model
        finally:
            surface._register_deepspeed_module(surface.module)
