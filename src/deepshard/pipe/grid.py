"""DeepSpeed's grid objects for pipeline models: ``ProcessTopology`` (named axes -> ranks, row-major) and
``PipelineParallelGrid`` (what ``PipelineModule.mpu()`` returns), answered from deepshard's one grid.

A ``PipelineModule`` builds its grid when it is constructed, as DeepSpeed's does, so a script can ask
``net.mpu().get_data_parallel_rank()`` before ``initialize`` (DeepSpeed's pipeline examples build their
``DistributedSampler`` from it). The grid holds a ``deepshard.topology.Topology``: the same process groups
the engine then trains on (``initialize`` takes them from the module instead of creating new ones).

Axis names are DeepSpeed's: ``pipe``, ``data``, ``model`` (tensor slicing). Rank order is DeepSpeed's and
deepshard's: ``rank = pipe * (data * model) + data * model + model``.
"""
from __future__ import annotations

import itertools
from collections import namedtuple
from typing import Any, Optional, Sequence

from deepshard.topology import ParallelDims, Topology, own_group


def prime_factors(n: int) -> list[int]:
    """The prime factors of ``n`` in ascending order, with multiplicity (``12`` -> ``[2, 2, 3]``; ``1`` ->
    ``[]``); ways to split ``n`` ranks over axes."""
    if n <= 0:
        raise ValueError(f"prime factors are defined for positive integers, got {n}")
    factors, d = [], 2
    while d * d <= n:
        while n % d == 0:
            factors.append(d)
            n //= d
        d += 1
    return factors + ([n] if n > 1 else [])


_prime_factors = prime_factors  # DeepSpeed's name (deepspeed.runtime.pipe.topology._prime_factors)


class ProcessTopology:
    """Named axes of given sizes mapped to global ranks, the last axis fastest (row-major)."""

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology needs one size per axis: axes={list(axes)} dims={list(dims)}")
        self.axes = list(axes)
        self.dims = [int(d) for d in dims]
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)  # type: ignore[misc]
        self.mapping: dict[Any, int] = {}
        for rank, values in enumerate(itertools.product(*(range(d) for d in self.dims))):
            self.mapping[self.ProcessCoord(*values)] = rank

    def get_rank(self, **coord: int) -> int:
        """The global rank at the coordinate given by every axis, e.g. ``get_rank(pipe=1, data=0)``."""
        if sorted(coord) != sorted(self.axes):
            raise ValueError(f"get_rank() needs every axis of {self.axes}, got {sorted(coord)}; "
                             "use filter_match() for a slice")
        key = self.ProcessCoord(**coord)
        if key not in self.mapping:
            raise ValueError(f"coordinate {coord} is outside the topology {dict(zip(self.axes, self.dims))}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """The size of ``axis`` (0 when the topology has no such axis, as DeepSpeed answers)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        """The ``ProcessCoord`` namedtuple of global ``rank``."""
        for key, value in self.mapping.items():
            if value == rank:
                return key
        raise ValueError(f"rank {rank} is outside 0..{self.world_size() - 1}")

    def get_rank_repr(self, rank: int, omit_axes: Sequence[str] = ("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """E.g. ``model_01`` for the model axis: the axes not omitted, each as name + 2-digit index."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes
                              if axis not in omit_axes)

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``: the ranks that agree on all other axes (empty for an unknown axis)."""
        if axis not in self.axes:
            return []
        groups: dict[tuple[int, ...], list[int]] = {}
        for key, rank in sorted(self.mapping.items(), key=lambda kv: kv[1]):
            others = tuple(getattr(key, a) for a in self.axes if a != axis)
            groups.setdefault(others, []).append(rank)
        return [groups[k] for k in sorted(groups)]

    def filter_match(self, **criteria: int) -> list[int]:
        """The ranks whose coordinates match every ``axis=value`` given."""
        return [rank for key, rank in sorted(self.mapping.items(), key=lambda kv: kv[1])
                if all(getattr(key, a) == v for a, v in criteria.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose ``axis`` coordinate is ``idx``."""
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism (axes ``pipe``, ``data``)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x tensor parallelism (axes ``pipe``, ``data``, ``model``)."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def dims_of(topology: Any) -> ParallelDims:
    """deepshard's ``ParallelDims`` for a ``ProcessTopology``, ``ParallelDims`` or ``Topology``."""
    if isinstance(topology, ParallelDims):
        return topology
    if isinstance(topology, Topology):
        return topology.dims
    if isinstance(topology, ProcessTopology):
        unknown = set(topology.axes) - {"pipe", "data", "model"}
        if unknown or topology.axes[:1] != ["pipe"] or ("model" in topology.axes and topology.axes[-1] != "model"):
            raise ValueError(f"topology axes {topology.axes}: deepshard's grid is pipe x data x model, in that "
                             "order; use PipeDataParallelTopology or PipeModelDataParallelTopology")
        return ParallelDims(pp=topology.get_dim("pipe"), dp=max(1, topology.get_dim("data")),
                            tp=max(1, topology.get_dim("model")))
    raise TypeError(f"topology= must be a ProcessTopology (deepspeed.pipe), a deepshard ParallelDims or Topology, "
                    f"got {type(topology).__name__}")


def process_topology(dims: ParallelDims) -> ProcessTopology:
    """DeepSpeed's topology object for ``dims`` (the ``model`` axis only when tensor parallelism is on)."""
    if dims.tp > 1:
        return PipeModelDataParallelTopology(num_pp=dims.pp, num_mp=dims.tp, num_dp=dims.dp)
    return PipeDataParallelTopology(num_pp=dims.pp, num_dp=dims.dp)


class PipelineParallelGrid:
    """DeepSpeed's (and Megatron's) ``mpu`` interface over a deepshard ``Topology``: ranks, sizes and the
    real torch process groups of each axis. ``get_model_parallel_*`` is the whole model replica
    (pipeline x tensor), as in DeepSpeed; ``get_slice_parallel_*`` / ``get_tensor_model_parallel_*`` the
    tensor-parallel axis."""

    def __init__(self, topology: Topology) -> None:
        self.grid_topology = topology
        self._topo = process_topology(topology.dims)
        self._singleton: Any = None
        dims, coord = topology.dims, topology.coord
        self.global_rank = topology.rank
        self.world_size = dims.world_size
        self.data_parallel_size, self.pipe_parallel_size = dims.dp, dims.pp
        self.model_parallel_size = self.slice_parallel_size = dims.tp
        self.stage_id, self.data_parallel_id = coord.pp, coord.dp
        self.is_first_stage = coord.pp == 0
        self.is_last_stage = coord.pp == dims.pp - 1
        self._singleton = self._make_singleton()

    def _make_singleton(self) -> Any:
        """This rank's own group, for the axes of size 1; made here, when every rank builds its grid (see
        ``topology.own_group``: the ranks must create the same number of groups), not when one rank asks."""
        import torch.distributed as dist

        sizes = [getattr(self.grid_topology, name).size for name in ("pp", "dp", "model_parallel", "tp")]
        if 1 not in sizes or not (dist.is_available() and dist.is_initialized()):
            return None
        return own_group([self.global_rank], self.global_rank, self.grid_topology.world.logger, "single").group

    def _torch_group(self, name: str) -> Any:
        """The torch process group of axis ``name`` (a size-1 axis: this rank's own group)."""
        import torch.distributed as dist

        comm = getattr(self.grid_topology, name)
        if comm.size == 1:
            if self._singleton is None:
                raise RuntimeError(f"the {name} axis has one rank but no process group was made for it: "
                                   "build the grid after torch.distributed.init_process_group")
            return self._singleton
        return comm.group if comm.group is not None else dist.group.WORLD

    # ---------------------------------------------------------------------------- DeepSpeed's names
    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **coord: int) -> int:
        """The global rank of ``stage_id`` at this rank's other coordinates (overridden by ``coord``)."""
        mine = self._topo.get_coord(self.global_rank)._replace(pipe=stage_id, **coord)
        return self._topo.get_rank(**mine._asdict())

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        return self._torch_group("pp")

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self._torch_group("dp")

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.grid_topology.dims.peers(self.global_rank, "dp"))

    def get_model_parallel_rank(self) -> int:
        return self.grid_topology.model_parallel.rank

    def get_model_parallel_world_size(self) -> int:
        return self.grid_topology.model_parallel.size

    def get_model_parallel_group(self) -> Any:
        return self._torch_group("model_parallel")

    def get_slice_parallel_rank(self) -> int:
        return self.grid_topology.coord.tp

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> Any:
        return self._torch_group("tp")

    # Megatron's spellings of the same
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group
    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group


def build_grid(num_stages: Optional[int], topology: Any) -> PipelineParallelGrid:
    """The grid a ``PipelineModule`` builds at construction (collective: every rank constructs the module):
    from ``topology`` when given (a deepshard ``Topology`` is used as it is), else ``num_stages`` x the data
    parallelism the world leaves."""
    import torch.distributed as dist

    if isinstance(topology, Topology):
        return PipelineParallelGrid(topology)
    world = dist.get_world_size()
    if topology is not None:
        dims = dims_of(topology)
    else:
        assert num_stages is not None  # _resolve_stage refused it otherwise
        dims = ParallelDims.for_world(world, pp=num_stages)
    return PipelineParallelGrid(Topology.build(dims))
