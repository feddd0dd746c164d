"""Turn an offload policy into the runtime objects a strategy uses: the one place that looks at which
policy it is."""
from __future__ import annotations

import torch

from deepshard.zero.offload.backing import Backing, FileBacking, HostBacking
from deepshard.zero.offload.param_store import OffloadedParamStore, ParamStore, ResidentParamStore
from deepshard.zero.offload.policy import CpuOffload, NvmeOffload, OffloadPolicy
from deepshard.zero.offload.states import ResidentStates, ShardStates, StatesSpec
from deepshard.zero.offload.subgroup_states import SubGroupStates
from deepshard.zero.offload.swapper import AsyncSwapper


def _backing(policy: OffloadPolicy, rank: int) -> Backing | None:
    if isinstance(policy, NvmeOffload):
        return FileBacking(AsyncSwapper(policy.path, rank, policy.aio))
    if isinstance(policy, CpuOffload) and policy.active:
        return HostBacking(policy.pin_memory)
    return None


def make_shard_states(policy: OffloadPolicy, spec: StatesSpec, sub_group_size: int) -> ShardStates:
    """The optimizer side of a ZeRO 1-3 shard under ``policy``."""
    backing = _backing(policy, spec.rank)
    if backing is None:
        return ResidentStates(spec)
    buffers = policy.buffer_count if isinstance(policy, NvmeOffload) else 1  # host memory needs no staging
    pin = bool(getattr(policy, "pin_memory", False))
    return SubGroupStates(spec, backing, buffers, pin, sub_group_size, "offload_optimizer")


def make_param_store(policy: OffloadPolicy, numel: int, dtype: torch.dtype, device: torch.device,
                     rank: int) -> ParamStore:
    """Where a ZeRO-3 parameter shard of ``numel`` elements lives under ``policy``."""
    backing = _backing(policy, rank)
    if backing is None:
        return ResidentParamStore(numel, dtype, device)
    return OffloadedParamStore(numel, dtype, device, backing, bool(getattr(policy, "pin_memory", False)))
