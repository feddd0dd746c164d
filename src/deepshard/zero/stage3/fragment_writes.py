"""ZeRO-3's side of ``deepshard.zero.fragment_access``: where a written value and gradient go.

A piece's new fp32 value is also this rank's part of the parameter shard (``ds_tensor``, in the model's
dtype): written there straight away (when the optimizer keeps fp32 masters; otherwise the piece *is* the
shard). A full write also replaces the gathered values of a group held gathered (persistent groups, or a
write inside a forward), on every rank, as each rank has the full value; a local write marks such a group
stale instead, and its next forward gathers it again (``ShardedGroup.mark_stale``: a collective then, so
every rank calls the local writer, each with its own part); hpZ's secondary copy is marked stale. A gradient piece is a range of the gradient shard (in memory, or in the optimizer's swap file).
"""
from __future__ import annotations

from typing import Any

import torch

from deepshard.zero.fragment_access import FragmentAccess
from deepshard.zero.stage3.group import GroupState


def stage3_access(strategy: Any) -> FragmentAccess:
    """The writers and local readers over ``strategy``'s pieces (a ``Stage3Strategy``, which calls this)."""
    opt_shard = strategy.opt_shard

    def publish(param: torch.nn.Parameter, written: list[tuple[int, torch.Tensor]], full: torch.Tensor | None) -> None:
        if strategy.states.has_masters:
            for i, part in written:
                strategy.param_store.write(opt_shard.fragments[i].shard_start, part)
            strategy.param_store.flush()
        group = strategy.group_of(param)
        if group is None:
            return
        group.invalidate_secondary()
        if full is None:  # a local write: the other ranks' parts of the gathered copy are not known here
            group.mark_stale()
        elif group.state is GroupState.GATHERED:
            param.data.copy_(full.reshape(param.shape))

    def write_grad(i: int, part: torch.Tensor) -> None:
        strategy.grads.write(opt_shard.fragments[i].shard_start, part)

    return FragmentAccess(opt_shard, publish, write_grad, 3, local=True, grads_kept=not strategy.steps_in_backward)
