"""DeepSpeed's ``deepspeed.utils.groups`` sequence-parallel accessors.

DeepSpeed answers these from a process-wide registry that ``deepspeed.initialize(mpu=...)`` fills; scripts
call them with no argument (``groups._get_sequence_parallel_group()``), so deepshard keeps the one grid that
registered last: the grid of ``UlyssesSPAttentionHF.register_with_transformers`` or of the latest engine
built with ``sequence_parallel_size`` > 1. The groups are real torch process groups (None stands for the
whole world, as torch reads it), which scripts pass to ``torch.distributed.nn.functional`` collectives.
deepshard's own code never reads this registry: it passes ``Topology`` objects.
"""
from __future__ import annotations

from typing import Any, Optional

from deepshard.topology import Topology

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
