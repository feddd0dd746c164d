"""How big an offloaded optimizer's sub-groups and staging pool are, when the config does not say.

What stays resident while offloaded states are stepped is the staging pool: ``buffer_count`` buffers
of one sub-group's tensor each (``sub_group_size`` x 4 bytes), plus one sub-group's fp32 gradient (two,
read ahead into reused buffers, when ZeRO-3's gradient shard is on disk).
DeepSpeed's defaults (``sub_group_size`` 1e9, 4 buffers) make one sub-group the whole shard for any
model under a few billion parameters per process, so the pool holds four shard-sized fp32 tensors:
more than the states it was meant to move off the device (the 16Ψ/N of in-memory ZeRO-3 becomes
2Ψ/N of gradients + 16Ψ/N of pool). So, with offload switched on:

- ``sub_group_size`` left out (or ``"auto"``): a sub-group is 1/64 of the shard, at least
  :data:`MIN_SUB_GROUP` elements (fewer, larger reads for small models) and small enough that the
  pool takes at most 1/16 of the host memory available to each local process;
- ``buffer_count`` left out: two buffers per tensor of a sub-group (master weights, when kept, and
  two optimizer states as Adam has), so reads and writes overlap the update;
- a value the config gives is used as given.

The pool then holds ``buffer_count / 64`` of one shard-sized tensor (about Ψ/N x 0.4 bytes for Adam
with master weights, against 12Ψ/N bytes of fp32 master weights and Adam state it keeps off the device).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

STAGING_ELEMENT_BYTES = 4
SHARD_FRACTION = 64
MIN_SUB_GROUP = 1 << 18
MEMORY_FRACTION = 16
ELEMENTWISE_STATES = 2  # Adam / AdamW (exp_avg, exp_avg_sq): the common case the default is sized for


@dataclass(frozen=True)
class StagingPlan:
    """The sub-group size and staging-buffer count an offloaded optimizer runs with, and why."""

    sub_group_size: int
    buffer_count: int
    reason: str

    @property
    def pool_bytes(self) -> int:
        """The staging pool at its fullest."""
        return self.buffer_count * self.sub_group_size * STAGING_ELEMENT_BYTES


def local_processes() -> int:
    """Processes sharing this host's memory: the launcher's ``LOCAL_WORLD_SIZE``, else (to be safe)
    ``WORLD_SIZE``, else 1."""
    for key in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        try:
            return max(1, int(os.environ[key]))
        except (KeyError, ValueError):
            continue
    return 1


def _sub_group_reason(size: int, shard_numel: int, by_shard: int, by_memory: int) -> str:
    """Which bound of the rule set ``size``, said so that the log never contradicts its own rule."""
    if size == max(shard_numel, 1) and size < by_shard and size <= by_memory:
        return f"the whole {shard_numel:,}-element shard: smaller than the {MIN_SUB_GROUP:,}-element minimum"
    if size == by_memory and by_memory < by_shard:
        return "as large as the host-memory limit below allows"
    if by_shard == MIN_SUB_GROUP:
        return (f"the {MIN_SUB_GROUP:,}-element minimum: 1/{SHARD_FRACTION} of the {shard_numel:,}-element "
                "shard is smaller")
    return f"1/{SHARD_FRACTION} of the {shard_numel:,}-element shard"


def plan_staging(shard_numel: int, has_masters: bool, available_bytes: int, processes: int,
                 sub_group_size: int | None, buffer_count: int | None) -> StagingPlan:
    """Sizes for a shard of ``shard_numel`` elements. ``sub_group_size`` / ``buffer_count``: the
    config's values, None where left out; ``available_bytes``: host memory available now, shared by
    ``processes`` local processes. See the module docstring for the rule."""
    tensors = (1 if has_masters else 0) + ELEMENTWISE_STATES
    notes = []
    if buffer_count is None:
        buffer_count = 2 * tensors
        notes.append(f"buffer_count {buffer_count} (2 per tensor of a sub-group: "
                     f"{'master weights + ' if has_masters else ''}{ELEMENTWISE_STATES} optimizer states)")
    if sub_group_size is None:
        budget = max(available_bytes, 0) // (MEMORY_FRACTION * max(processes, 1))
        by_memory = max(budget // (buffer_count * STAGING_ELEMENT_BYTES), 1)
        by_shard = max(-(-shard_numel // SHARD_FRACTION), MIN_SUB_GROUP)
        sub_group_size = max(1, min(by_shard, by_memory, max(shard_numel, 1)))
        why = _sub_group_reason(sub_group_size, shard_numel, by_shard, by_memory)
        notes.append(f"sub_group_size {sub_group_size:,} ({why}; the pool takes at most 1/{MEMORY_FRACTION} of "
                     f"the {available_bytes / 2**30:.1f} GiB available to {processes} local process(es))")
    reason = "; ".join(notes) if notes else "both given in the config"
    return StagingPlan(int(sub_group_size), int(buffer_count), reason)
