"""The run's ``SequenceParallel`` when ``sequence_parallel_size`` > 1: the one an mpu from
``register_with_transformers`` carries, else one built from the config. The engine takes it whole
(``EngineParts.sequence_parallel``) and answers DeepSpeed's names for its groups (``seq_parallel_group``,
``sequence_parallel_size``, ``seq_data_parallel_group``, ``seq_dp_world_size``, ``get_sequence_parallel_group()``)."""
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
