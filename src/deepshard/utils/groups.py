"""DeepSpeed's ``deepspeed.utils.groups`` sequence-parallel and expert-parallel accessors.

DeepSpeed answers these from a process-wide registry that ``deepspeed.initialize(mpu=...)`` fills; scripts
call them with no argument (``groups._get_sequence_parallel_group()``), so deepshard keeps the one grid that
registered last: the grid of ``UlyssesSPAttentionHF.register_with_transformers`` or of the latest engine
built with ``sequence_parallel_size`` > 1. The groups are real torch process groups (None stands for the
whole world, as torch reads it), which scripts pass to ``torch.distributed.nn.functional`` collectives.
deepshard's own code never reads this registry: it passes ``Topology`` objects.
"""
from __future__ import annotations

from typing import Any, Optional

from deepshard.topology import ParallelDims, Topology

_REGISTERED: dict[str, Any] = {}  # the DeepSpeed API's process-wide state: one grid and its sp layout at most


def register_topology(topology: Topology, sequence_parallel: Any = None) -> None:
    """Make ``topology`` the grid these accessors answer for; ``sequence_parallel`` (a
    ``deepshard.sp.SequenceParallel``, or None) tells ``UlyssesSPDataLoaderAdapter`` which tokens each rank
    holds (ring and hybrid modes cut the sequence otherwise than Ulysses)."""
    _REGISTERED["current"] = topology
    _REGISTERED["sequence_parallel"] = sequence_parallel


def forget_topology() -> None:
    _REGISTERED.clear()


def _topology() -> Optional[Topology]:
    return _REGISTERED.get("current")


def registered_sequence_parallel() -> Any:
    """The ``SequenceParallel`` registered with the grid (None: none, or plain Ulysses layout)."""
    return _REGISTERED.get("sequence_parallel")


def _require() -> Topology:
    topology = _topology()
    if topology is None:
        raise KeyError("No sequence parallel group found: call UlyssesSPAttentionHF.register_with_transformers(...) "
                       "or deepshard.initialize with \"sequence_parallel_size\" > 1 first")
    return topology


def _get_sequence_parallel_group() -> Any:
    """The torch process group of this rank's sequence-parallel peers."""
    return _require().sp.group  # type: ignore[union-attr]


def _get_sequence_parallel_world_size() -> int:
    topology = _topology()
    return 1 if topology is None else topology.sp.size  # type: ignore[union-attr]


def _get_sequence_parallel_rank() -> int:
    topology = _topology()
    return 0 if topology is None else topology.sp.rank  # type: ignore[union-attr]


def _get_sequence_data_parallel_group() -> Any:
    """dp x sp: where ZeRO shards and reduces."""
    return _require().seq_dp.group  # type: ignore[union-attr]


def _get_sequence_data_parallel_world_size() -> int:
    topology = _topology()
    return _world_size() if topology is None else topology.seq_dp.size  # type: ignore[union-attr]


def _get_sequence_data_parallel_rank() -> int:
    topology = _topology()
    return _world_rank() if topology is None else topology.seq_dp.rank  # type: ignore[union-attr]


def _get_data_parallel_group() -> Any:
    topology = _topology()
    return None if topology is None else topology.dp.group


def _get_data_parallel_world_size() -> int:
    topology = _topology()
    return _world_size() if topology is None else topology.dp.size


def _get_data_parallel_rank() -> int:
    topology = _topology()
    return _world_rank() if topology is None else topology.dp.rank


def _get_model_parallel_world_size() -> int:
    topology = _topology()
    return 1 if topology is None else topology.model_parallel.size


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _world_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# ------------------------------------------------------------------------------------ expert parallelism
# DeepSpeed's expert-group accessors, keyed by group name (``ep_size_<P>``): they answer for the grid of the
# latest engine built with MoE layers (``register_expert_topology``), independently of the sequence-parallel
# registration above.

def register_expert_topology(topology: Topology) -> None:
    """Make ``topology`` (with its ``experts`` groups) the grid the expert accessors answer for."""
    _REGISTERED["experts"] = topology


def _expert_groups() -> dict[str, Any]:
    topology = _REGISTERED.get("experts")
    return dict(topology.experts) if topology is not None else {}


def _expert(group_name: str) -> Any:
    groups = _expert_groups()
    if group_name not in groups:
        raise KeyError(f"expert parallel group {group_name!r} does not exist: deepshard.initialize makes the groups "
                       f"of the model's MoE layers (ep_size_<ep_size>); known: {sorted(groups)}")
    return groups[group_name]


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    """DeepSpeed's deprecated ``groups.initialize``: refused, as DeepSpeed refuses it."""
    raise RuntimeError("deepspeed.utils.groups.initialize is deprecated: pass ep_size to deepspeed.moe.layer.MoE "
                       "(the groups are made at deepspeed.initialize)")


def _get_expert_parallel_ranks(world_size: int, tensor_parallel_size_: int, expert_parallel_size_: int,
                               pipeline_parallel_size_: int = 1, use_data_before_expert_parallel_: bool = False
                               ) -> tuple[list[list[int]], list[list[int]]]:
    """DeepSpeed's layout of the expert-parallel and expert-data-parallel groups of a world (every group as
    global ranks, no process group made): the grid's :meth:`~deepshard.topology.ParallelDims.expert_group_ranks`
    on ``world_size`` ranks of ``pipeline_parallel_size_`` x data x ``tensor_parallel_size_``."""
    dims = ParallelDims.for_world(world_size, pp=pipeline_parallel_size_, tp=tensor_parallel_size_)
    return dims.expert_group_ranks(expert_parallel_size_, use_data_before_expert_parallel_)


def _get_expert_parallel_group(group_name: str) -> Any:
    """The torch process group of this rank's expert-parallel peers (the all-to-all's)."""
    return _expert(group_name).ep.group


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return list(_expert(group_name).ep_ranks)


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    return {name: groups.ep.group for name, groups in _expert_groups().items()}


def _get_expert_data_parallel_group(group_name: str) -> Any:
    """The torch process group of the ranks holding the same experts (expert gradients are reduced here)."""
    return _expert(group_name).edp.group


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return list(_expert(group_name).edp_ranks)


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    return {name: groups.edp.group for name, groups in _expert_groups().items()}


def _get_expert_parallel_world_size(group_name: str) -> int:
    return int(_expert(group_name).ep.size)


def _get_expert_parallel_rank(group_name: str) -> int:
    return int(_expert(group_name).ep.rank)


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """The first global rank of this rank's expert-parallel group."""
    return int(_expert(group_name).ep_ranks[0])


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return int(_expert(group_name).edp.size)


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return int(_expert(group_name).edp.rank)


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """The global rank expert parameters are broadcast from at initialize (its expert-data-parallel group's first)."""
    return int(min(_expert(group_name).edp_ranks))


def _get_max_expert_size() -> Optional[int]:
    """The largest ep_size of the registered MoE layers (None: none)."""
    sizes = [groups.ep_size for groups in _expert_groups().values()]
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group() -> Any:
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_model_parallel_world_size() -> int:
    """Experts are not split over tensor-parallel ranks in deepshard: 1."""
    return 1
