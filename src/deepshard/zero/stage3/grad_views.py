"""DeepSpeed's per-parameter views of ZeRO-3's reduced gradients, read from deepshard's gradient store.

DeepSpeed's ZeRO-3 optimizer splits every parameter on its own: rank ``r`` holds elements
``[r * c, (r + 1) * c)`` of the flattened parameter, ``c = ceil(numel / world)``, the last rank's part
zero-padded to ``c``; ``averaged_gradients`` and ``get_fp32_grad_partitions()`` hand out each parameter's
reduced gradient in that layout, per optimizer parameter group.

deepshard partitions a *group* of parameters (a module's, or a small subtree's: ``units.py``) as one flat,
padded buffer split in equal chunks, so a parameter's part on a rank is wherever the group's chunk
boundaries fall. The reduced gradients live in the strategy's gradient store (``offload/grad_store.py``)
in that group layout, accumulated over backward passes until the step zeroes them. This module gives
DeepSpeed's layout from that store:

* a parameter alone in its group is split exactly as DeepSpeed splits it (the group's padding is the
  parameter's), so its part is a view of the store (a copy read back where the store is on disk);
* a parameter sharing its group is assembled across ranks (``ShardedOptimizer.full_grad``, an all-reduce of
  the parameter's gradient) and this rank's DeepSpeed part is cut from it: a copy, and a collective, so
  every rank of the data-parallel group must ask together (DeepSpeed's tests and checkpoint code do).

Nothing is kept between calls: each call reads the store as it is then.
"""
from __future__ import annotations

from typing import Any

import torch


def deepspeed_part(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``full`` in DeepSpeed's per-parameter split: ``ceil(numel / world)``
    elements, zero-padded past the end of the parameter."""
    flat = full.reshape(-1)
    chunk = max(-(-flat.numel() // world), 1)
    out = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
    piece = flat[rank * chunk:(rank + 1) * chunk]
    out[:piece.numel()] = piece
    return out


class Stage3GradViews:
    """The reduced gradients of a ``Stage3Strategy`` as DeepSpeed's per-parameter partitions, for the ZeRO-3
    optimizer's ``get_fp32_grad_partitions()`` / ``averaged_gradients`` (``zero/zero_optimizer.py``)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        layout = strategy.layout
        self.slot_of = {id(strategy.params[s.param_index]): s for s in layout.slots}

    def partitions(self, fp32: bool) -> dict[int, list[torch.Tensor]]:
        """``{parameter group index: [this rank's gradient part of each trainable parameter of the group, in the
        group's order]}``; ``fp32``: as float32 (a copy only where the store holds 16-bit gradients), else in
        the store's dtype. A collective where a group holds parameters that share a partition group."""
        s = self.strategy
        if s.steps_in_backward:
            raise RuntimeError("the gradient partitions are not kept with zero_optimization.optimizer_step_in_backward: "
                               "each reduced gradient is applied and dropped during backward; turn the option off "
                               "to read them")
        out: dict[int, list[torch.Tensor]] = {}
        for gi, params in enumerate(s.opt_shard.user_groups):
            parts = [self._part(p) for p in params]
            out[gi] = [t.float() for t in parts] if fp32 else parts
        return out

    def _part(self, param: torch.nn.Parameter) -> torch.Tensor:
        s = self.strategy
        slot = self.slot_of[id(param)]
        bucket = s.layout.buckets[slot.bucket]
        if bucket.numel == slot.numel:  # alone in its group: the group's chunk is DeepSpeed's part
            return s.grads.pieces([(s.layout.shard_offset(bucket), bucket.chunk)])[0]
        full = s.full_grad(param)
        if full is None:  # not reachable: every parameter here is trainable
            raise RuntimeError(f"parameter '{slot.name}' has no gradient store")
        return deepspeed_part(full, bucket.world, bucket.rank).to(s.ctx.precision.param_dtype)
