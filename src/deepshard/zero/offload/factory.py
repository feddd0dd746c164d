"""Turn an offload policy into the runtime objects a strategy uses: the one place that looks at which
policy it is."""
from __future__ import annotations

import psutil
import torch

from deepshard.utils.logging import logger
from deepshard.zero.offload.backing import Backing, FileBacking, HostBacking
from deepshard.zero.offload.grad_store import GradShard, OffloadedGradShard, ResidentGradShard
from deepshard.zero.offload.mapped import MappedFileBacking
from deepshard.zero.offload.param_store import OffloadedParamStore, ParamStore, ResidentParamStore
from deepshard.zero.offload.policy import CpuOffload, NvmeOffload, OffloadPolicy
from deepshard.zero.offload.sizing import StagingPlan, local_processes, plan_staging
from deepshard.zero.offload.states import ResidentStates, ShardStates, StatesSpec
from deepshard.zero.offload.subgroup_states import SubGroupStates
from deepshard.zero.offload.swapper import AsyncSwapper


def _backing(policy: OffloadPolicy, rank: int, device: torch.device) -> Backing | None:
    if isinstance(policy, NvmeOffload):
        swapper = AsyncSwapper(policy.path, rank, policy.aio)
        # computing on the CPU, the files are used in place (no copies in and out of staging buffers);
        # an accelerator's transfers want the staged path's pinned buffers
        return MappedFileBacking(swapper) if device.type == "cpu" else FileBacking(swapper)
    if isinstance(policy, CpuOffload) and policy.active:
        return HostBacking(policy.pin_memory)
    return None


def staging_plan(policy: OffloadPolicy, spec: StatesSpec) -> StagingPlan:
    """Sub-group size and staging buffers: the config's values, the rest sized from memory (logged)."""
    # host memory needs no staging: one buffer, only for tensors a backing cannot view
    count = policy.buffer_count if isinstance(policy, NvmeOffload) else 1
    plan = plan_staging(spec.shard_numel, spec.offloaded_masters, int(psutil.virtual_memory().available),
                        local_processes(), getattr(policy, "sub_group_size", None), count)
    if spec.rank == 0:
        logger.info("zero_optimization.offload_optimizer (%s): sub-groups of %s elements, %d staging buffer(s), "
                    "at most %.1f MiB resident (%s)", policy.device, f"{plan.sub_group_size:,}", plan.buffer_count,
                    plan.pool_bytes / 2**20, plan.reason)
    return plan


def make_shard_states(policy: OffloadPolicy, spec: StatesSpec) -> ShardStates:
    """The optimizer side of a ZeRO 1-3 shard under ``policy``."""
    backing = _backing(policy, spec.rank, spec.device)
    if backing is None:
        return ResidentStates(spec)
    plan = staging_plan(policy, spec)
    pin = bool(getattr(policy, "pin_memory", False))
    return SubGroupStates(spec, backing, plan.buffer_count, pin, plan.sub_group_size, "offload_optimizer")


def make_param_store(policy: OffloadPolicy, numel: int, dtype: torch.dtype, device: torch.device,
                     rank: int) -> ParamStore:
    """Where a ZeRO-3 parameter shard of ``numel`` elements lives under ``policy``."""
    backing = _backing(policy, rank, device)
    if backing is None:
        return ResidentParamStore(numel, dtype, device)
    return OffloadedParamStore(numel, dtype, device, backing, bool(getattr(policy, "pin_memory", False)))


def make_grad_shard(states: ShardStates, numel: int, dtype: torch.dtype, device: torch.device,
                    ranges: list[tuple[int, int]], norm_chunk: int) -> GradShard:
    """Where ZeRO-3's reduced gradients wait for the step: in the optimizer's swap files when its states
    are on disk (the step reads them there, a sub-group at a time), else on the device."""
    backing = getattr(states, "backing", None)
    if isinstance(backing, FileBacking) and numel > 0:
        return OffloadedGradShard(backing, numel, dtype, device, ranges, norm_chunk)
    return ResidentGradShard(numel, dtype, device)
