"""What ``deepshard.initialize`` adds to an engine when ``sequence_parallel_size`` > 1: the
``SequenceParallel`` object (``engine.sequence_parallel``) and DeepSpeed's engine names for the groups
(``seq_parallel_group``, ``sequence_parallel_size``, ``seq_data_parallel_group``, ``seq_dp_world_size``,
``get_sequence_parallel_group()``)."""
from __future__ import annotations

from typing import Any

from deepshard.sp.api import SequenceParallel
from deepshard.topology import Topology


def build_sequence_parallel(topology: Topology, cfg: Any, mpu: Any) -> SequenceParallel | None:
    """The run's ``SequenceParallel``: the one the mpu carries (``register_with_transformers``), else built
    from the config's ``sequence_parallel`` section (collective). None when sp is 1."""
    if topology.dims.sp == 1:
        return None
    carried = getattr(mpu, "deepshard_sequence_parallel", None)
    if isinstance(carried, SequenceParallel):
        return carried
    return SequenceParallel.from_config(topology, cfg.sequence_parallel)


def attach_sequence_parallel(engine: Any, sp: SequenceParallel | None) -> None:
    topology = engine.topology
    if sp is not None:
        from deepshard.utils.groups import register_topology

        register_topology(topology, sp)  # deepspeed.utils.groups' accessors answer for this grid
    engine.sequence_parallel = sp
    engine.sequence_parallel_size = topology.dims.sp
    engine.seq_parallel_group = topology.sp.group if sp is not None else None
    engine.seq_data_parallel_group = topology.seq_dp.group
    engine.seq_dp_world_size = topology.seq_dp.size
    engine.get_sequence_parallel_group = lambda: engine.seq_parallel_group
