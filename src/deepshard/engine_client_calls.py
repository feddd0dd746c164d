"""DeepSpeed engine calls that clients make besides training and config reads.

``set_data_post_process_func``, ``empty_partition_cache`` and ``get_compile_time`` do what DeepSpeed does in the
configurations deepshard supports; ``allreduce_gradients`` finishes the gradient reduction of the last backward;
``offload_states`` / ``reload_states`` are refused with an error that says what to use instead.
"""
from __future__ import annotations

import gc
from typing import Any, Callable, Container, Optional

from deepshard.utils.logging import logger


class EngineClientCalls:
    """Mixed into the engine, which sets ``accelerator``, ``topology``, ``_config``, ``training_dataloader`` and
    ``strategy``."""

    accelerator: Any
    topology: Any
    training_dataloader: Any
    _config: Any
    strategy: Any

    def set_data_post_process_func(self, post_process_func: Optional[Callable[..., Any]]) -> None:
        """Keep ``post_process_func`` on the training dataloader, as DeepSpeed does. DeepSpeed calls it only on
        batches of its curriculum-learning data sampler; deepshard has no curriculum learning (the config
        refuses it), so the function is stored and, as in DeepSpeed without curriculum learning, never called."""
        self._data_post_process_func = post_process_func
        if self.training_dataloader is not None:
            self.training_dataloader.post_process_func = post_process_func
        if post_process_func is not None:
            logger.info("set_data_post_process_func: kept but not called: it applies to curriculum-learning "
                        "batches only and curriculum learning is off")

    def empty_partition_cache(self) -> None:
        """Free cached device memory. DeepSpeed drops the ZeRO-3 parameters it keeps gathered between steps;
        deepshard's ZeRO-3 releases each gathered parameter after its use, so between steps only the
        allocator's cache is left, which this returns to the device."""
        gc.collect()
        self.accelerator.empty_cache()

    def get_compile_time(self) -> dict[str, float]:
        """Seconds spent in each DeepCompile pass: always empty, as DeepSpeed without DeepCompile
        (deepshard does not implement DeepCompile; ``engine.compile()`` runs ``torch.compile``)."""
        return {}

    def offload_states(self, include: Optional[Container[Any]] = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Refused: moving the engine's states off the device on demand is not implemented."""
        raise NotImplementedError(
            "engine.offload_states() is not implemented in deepshard: to keep optimizer states or parameters in "
            "host memory for the whole run, use zero_optimization.offload_optimizer / offload_param "
            "({\"device\": \"cpu\"}) instead; to free the engine's device memory, use engine.destroy()")

    def reload_states(self, non_blocking: bool = False) -> None:
        """Refused, as :meth:`offload_states` (nothing is ever offloaded on demand)."""
        raise NotImplementedError(
            "engine.reload_states() is not implemented in deepshard because engine.offload_states() is not: "
            "use zero_optimization.offload_optimizer / offload_param in the config instead")

    def allreduce_gradients(self, bucket_size: int = 500_000_000) -> None:
        """Finish reducing the gradients of the backward that just ran: what has not been reduced yet is
        reduced now, and the reductions in flight are waited for (a collective: every data-parallel rank calls
        it). DeepSpeed's engine calls this inside ``backward``; deepshard's ``engine.backward`` has already
        reduced at its end, so after it this only confirms that the gradients are reduced, and calling it
        again reduces nothing twice. It matters after a backward the engine did not run (``loss.backward()`` on
        ``engine.scale(loss)``): the gradients are reduced here instead of in ``engine.step()``. As in
        ``engine.backward``, gradients are reduced at the accumulation boundary only (ZeRO-2/3: at every
        backward), and not inside ``no_sync()`` or ``coalesce_grad_reduction()``. ``bucket_size`` is accepted
        and not used: the buckets are the config's ``zero_optimization.reduce_bucket_size``."""
        self.strategy.end_backward()
