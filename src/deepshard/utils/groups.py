"""DeepSpeed's ``deepspeed.utils.groups`` accessors, answered from the grids deepshard built last.

DeepSpeed answers these from process-wide group variables that ``deepspeed.initialize(mpu=...)`` fills, and
scripts call them with no argument (``groups._get_sequence_parallel_group()``). deepshard keeps no groups
here: the groups live on a ``Topology``, owned by its engine (or by the mpu and the attention of
``UlyssesSPAttentionHF.register_with_transformers``), and this module only remembers, weakly, which grid
was set up last for each purpose (:func:`remember_grid`, called by ``deepshard.initialize`` for every
engine and by ``register_with_transformers``):

- ``"sequence"``: the latest grid with sequence parallelism (``sequence_parallel_size`` > 1, or the
  grid of ``register_with_transformers``): the sequence- and data-parallel accessors;
- ``"experts"``: the latest grid with MoE layers' expert-parallel groups: the expert accessors.

When that grid is gone (its engine and mpu released) the accessors answer as for no grid. deepshard's own
code never asks here: it passes ``Topology`` objects.

Adding accessors (another kind of group): record the grid under a purpose of its own in
:func:`remember_grid`, read it with :func:`latest_grid` and answer the single-process value when it is
None.

The groups are real torch process groups (None stands for the whole world, as torch reads it), which
scripts pass to ``torch.distributed.nn.functional`` collectives.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Literal, Optional

from deepshard.topology import ParallelDims, Topology

if TYPE_CHECKING:
    from deepshard.sp.api import SequenceParallel

Purpose = Literal["sequence", "experts"]


class _LatestGrids:
    """The latest grid of each purpose and the sequence-parallel layout, held weakly (kept alive by their
    engine or mpu, never from here)."""

    def __init__(self) -> None:
        self._grids: dict[str, weakref.ref[Topology]] = {}
        self._sequence_parallel: Optional[weakref.ref[SequenceParallel]] = None

    def set(self, purpose: Purpose, topology: Topology) -> None:
        self._grids[purpose] = weakref.ref(topology)

    def set_sequence_parallel(self, sequence_parallel: Optional[SequenceParallel]) -> None:
        self._sequence_parallel = None if sequence_parallel is None else weakref.ref(sequence_parallel)

    def get(self, purpose: Purpose) -> Optional[Topology]:
        found = self._grids.get(purpose)
        return None if found is None else found()

    def sequence_parallel(self) -> Optional[SequenceParallel]:
        return None if self._sequence_parallel is None else self._sequence_parallel()

    def clear(self) -> None:
        self._grids.clear()
        self._sequence_parallel = None


_LATEST = _LatestGrids()
"""Which grids the accessors answer for: weak pointers, no process group of their own."""


def remember_grid(topology: Topology, sequence_parallel: Optional[SequenceParallel] = None) -> None:
    """Make ``topology`` the grid the accessors of each purpose it serves answer for: sequence parallelism
    when it has some (or ``sequence_parallel`` is given: it tells ``UlyssesSPDataLoaderAdapter`` which
    tokens each rank holds, ring and hybrid modes cutting the sequence otherwise than Ulysses), expert
    parallelism when it has expert groups."""
    if sequence_parallel is not None or topology.dims.sp > 1:
        _LATEST.set("sequence", topology)
        _LATEST.set_sequence_parallel(sequence_parallel)
    if topology.experts:
        _LATEST.set("experts", topology)


def forget_grids() -> None:
    _LATEST.clear()


def latest_grid(purpose: Purpose) -> Optional[Topology]:
    """The latest grid remembered for ``purpose`` while it lives, else None."""
    return _LATEST.get(purpose)


def registered_sequence_parallel() -> Optional[SequenceParallel]:
    """The ``SequenceParallel`` of the latest sequence-parallel grid (None: none, or plain Ulysses layout)."""
    return _LATEST.sequence_parallel() if latest_grid("sequence") is not None else None


def _topology() -> Optional[Topology]:
    return latest_grid("sequence")


def _require() -> Topology:
    topology = _topology()
    if topology is None:
        raise KeyError("No sequence parallel group found: call UlyssesSPAttentionHF.register_with_transformers(...) "
                       "or deepshard.initialize with \"sequence_parallel_size\" > 1 first")
    return topology


def _get_sequence_parallel_group() -> Any:
    """The torch process group of this rank's sequence-parallel peers."""
    return _require().sp.group


def _get_sequence_parallel_world_size() -> int:
    topology = _topology()
    return 1 if topology is None else topology.sp.size


def _get_sequence_parallel_rank() -> int:
    topology = _topology()
    return 0 if topology is None else topology.sp.rank


def _get_sequence_data_parallel_group() -> Any:
    """dp x sp: where ZeRO shards and reduces."""
    return _require().seq_dp.group


def _get_sequence_data_parallel_world_size() -> int:
    topology = _topology()
    return _world_size() if topology is None else topology.seq_dp.size


def _get_sequence_data_parallel_rank() -> int:
    topology = _topology()
    return _world_rank() if topology is None else topology.seq_dp.rank


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
# DeepSpeed's expert-group accessors, keyed by group name (``ep_size_<P>``): they answer for the latest grid
# with MoE layers' expert groups (``latest_grid("experts")``).

def _expert_groups() -> dict[str, Any]:
    topology = latest_grid("experts")
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
