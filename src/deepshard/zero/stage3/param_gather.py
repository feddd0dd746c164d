"""How a ZeRO-3 parameter group is gathered: the one collective ``ShardedGroup.unshard`` starts.

- plain: an all-gather of the chunks over the shard group;
- ``mics_hierarchical_params_gather``: across machines first, then inside each (``comm/hierarchical.py``);
- qwZ (``zero_quantized_weights``): the chunks travel as 8-bit blocks and every rank decodes the same
  values (``comm/quantize.py``); groups kept gathered for good (``stage3_param_persistence_threshold``)
  are gathered in full precision: they are small, and gathered once per step;
- hpZ (``zero_hpz_partition_size``): the first gather after an update comes from the primary shards (over
  the whole shard group, quantized under qwZ) and leaves each rank of the hpZ group a *secondary* shard:
  its ``1/H`` of the gathered values. Every later gather until the next update (backward, and the
  forwards of later micro-batches) is an all-gather of the secondary shards inside the hpZ group, in
  the parameters' dtype: it gives back exactly the values the first gather gave.

An update (the optimizer step, a load, ``GatheredParameters`` with a modifier) makes the secondary shards
stale (``ShardedGroup.invalidate_secondary``).
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

import torch

from deepshard.comm.group import CommGroup
from deepshard.comm.hierarchical import Hierarchy, hierarchical_all_gather, quantized_all_gather



class Gathered(Protocol):
    """What a gather reads and writes of a group (``group.ShardedGroup``)."""

    full: torch.Tensor
    secondary: Optional[torch.Tensor]
    secondary_valid: bool
    persistent: bool
    source: Any
    padded: int
    dtype: torch.dtype
    device: torch.device


class ParamGather:
    """The gather of every group of one strategy (see the module docstring)."""

    def __init__(self, comm: CommGroup, hierarchy: Optional[Hierarchy] = None, quantized: bool = False,
                 hpz: Optional[CommGroup] = None) -> None:
        self.comm, self.hierarchy, self.quantized = comm, hierarchy, quantized
        self.hpz = hpz if hpz is not None and hpz.size > 1 else None

    @property
    def plain(self) -> bool:
        return self.hierarchy is None and not self.quantized and self.hpz is None

    def start(self, g: "Gathered", key: int) -> tuple[Any, bool]:
        """Launch ``g``'s gather into ``g.full``; returns ``(handle, whether the primary shard was read)``
        (the caller releases the shard source after the wait only then)."""
        if self.hpz is not None and g.secondary_valid and not g.persistent:
            return self.hpz.all_gather_into_tensor(g.full, g.secondary, async_op=True, key=key), False
        shard = g.source.acquire()
        if self.quantized and not g.persistent:
            return quantized_all_gather(self.comm, g.full, shard, key, self.hierarchy), True
        if self.hierarchy is not None:
            return hierarchical_all_gather(self.hierarchy, g.full, shard), True
        return self.comm.all_gather_into_tensor(g.full, shard, async_op=True, key=key), True

    def landed(self, g: "Gathered", from_primary: bool) -> None:
        """After a gather completed: keep the secondary shard of a primary gather (hpZ)."""
        if self.hpz is None or not from_primary or g.persistent:
            return
        size = g.padded // self.hpz.size
        if g.secondary is None:
            g.secondary = torch.empty(size, dtype=g.dtype, device=g.device)
        r = self.hpz.rank
        g.secondary.copy_(g.full[r * size:(r + 1) * size])
        g.secondary_valid = True

    def secondary_bytes(self, groups: list["Gathered"]) -> int:
        """Memory the secondary shards hold."""
        return sum(g.secondary.numel() * g.secondary.element_size() for g in groups if g.secondary is not None)


def param_gathers(comm: CommGroup, zero_groups: Any) -> tuple[ParamGather, ParamGather]:
    """(the trainable groups' gather, the frozen groups') of a strategy sharding over ``comm`` with
    ``zero_groups`` (``deepshard.zero.hierarchy.ZeroGroups``, or None for plain ZeRO-3). Frozen groups are
    quantized under ``zero_quantized_weights`` or ``zero_quantized_nontrainable_weights``."""
    if zero_groups is None:
        return ParamGather(comm), ParamGather(comm)
    s, h = zero_groups.settings, zero_groups.hierarchical_gather
    trainable = ParamGather(comm, h, s.quantized_weights, zero_groups.hpz)
    frozen = ParamGather(comm, h, s.quantized_weights or s.quantized_nontrainable_weights, zero_groups.hpz)
    return trainable, frozen
