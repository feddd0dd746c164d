"""The one place the process grid is decided: from a Megatron-style ``mpu``, from ``mesh_param``, or from
the config (``pipeline.stages`` / a ``PipelineModule``'s stages, ``tensor_parallel.autotp_size``,
``sequence_parallel_size``), with the data-parallel size what the world leaves. An mpu made by
``deepshard.sp`` (``UlyssesSPAttentionHF.register_with_transformers``) carries its grid.
``initialize`` calls ``build_topology`` once.
"""
from __future__ import annotations

from typing import Any, Optional

from deepshard.comm.group import CommGroup
from deepshard.comm.logger import CommsLogger
from deepshard.config.base import ConfigError
from deepshard.topology import Coord, ParallelDims, Topology, TopologyError


def _positive(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")
    return value


def dims_from_config(config: dict[str, Any], world_size: int, model: Any = None,
                     mesh_param: Any = None) -> ParallelDims:
    """The grid for ``world_size`` ranks from ``mesh_param=(dp, tp)``, the model's pipeline stages and
    the config's grid keys. Conflicting sources raise, naming both."""
    pp = int(getattr(model, "num_stages", 1) or 1)
    section = config.get("pipeline") if isinstance(config.get("pipeline"), dict) else {}
    stages = section.get("stages", "auto")
    if stages != "auto" and stages is not None and hasattr(model, "num_stages"):
        # (with a plain model the section changes nothing: config/inert.py says so)
        stages = _positive(stages, "pipeline.stages")
        if stages != pp:
            raise ConfigError(f"pipeline.stages is {stages} but the PipelineModule was built with num_stages={pp}; "
                              "remove pipeline.stages or make them equal")
        pp = stages
    tp_section = config.get("tensor_parallel") if isinstance(config.get("tensor_parallel"), dict) else {}
    recorded = getattr(model, "_deepshard_tp_model_init", None) or {}  # deepshard.tp_model_init's size
    tp = _positive(tp_section.get("autotp_size") or recorded.get("autotp_size") or 1, "tensor_parallel.autotp_size")
    sp = _positive(config.get("sequence_parallel_size") or 1, "sequence_parallel_size")
    dp: Optional[int] = None
    if mesh_param is not None:
        try:
            mesh_dp, mesh_tp = (int(x) for x in mesh_param)
        except (TypeError, ValueError):
            raise ConfigError(f"mesh_param must be a pair (data_parallel_size, tensor_parallel_size), "
                              f"got {mesh_param!r}") from None
        if tp != 1 and mesh_tp != tp:
            raise ConfigError(f"mesh_param gives tensor parallel size {mesh_tp} but tensor_parallel.autotp_size "
                              f"is {tp}; give one of them")
        dp, tp = mesh_dp, mesh_tp
    try:
        return ParallelDims.for_world(world_size, pp=pp, tp=tp, dp=dp, sp=sp)
    except TopologyError as exc:
        raise ConfigError(str(exc)) from None


def _mpu_call(mpu: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        fn = getattr(mpu, name, None)
        if callable(fn):
            return fn()
    return default


def topology_from_mpu(mpu: Any, logger: CommsLogger) -> Topology:
    """A topology over the groups of a Megatron-style ``mpu`` (as DeepSpeed takes Megatron-DeepSpeed's):
    its data-parallel group (required), tensor-parallel group (``get_tensor_model_parallel_group`` or
    ``get_model_parallel_group``) and, when present, its pipeline group."""
    import torch.distributed as dist

    if not callable(getattr(mpu, "get_data_parallel_group", None)):
        raise TypeError(f"mpu={type(mpu).__name__} has no get_data_parallel_group(): pass a Megatron-style object "
                        "with get_data_parallel_group/get_data_parallel_rank/get_data_parallel_world_size")
    dp_group = mpu.get_data_parallel_group()
    tp_group = _mpu_call(mpu, "get_tensor_model_parallel_group", "get_model_parallel_group")
    pp_group = _mpu_call(mpu, "get_pipeline_model_parallel_group", "get_pipe_parallel_group")
    dp_size = int(_mpu_call(mpu, "get_data_parallel_world_size", default=dist.get_world_size(dp_group)))
    tp_size = int(_mpu_call(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size",
                            default=1 if tp_group is None else dist.get_world_size(tp_group)))
    pp_size = int(_mpu_call(mpu, "get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size", default=1))
    dims = ParallelDims.for_world(dist.get_world_size(), pp=pp_size, tp=tp_size, dp=dp_size)
    coord = Coord(pp=int(_mpu_call(mpu, "get_pipeline_model_parallel_rank", "get_pipe_parallel_rank", default=0)),
                  dp=int(_mpu_call(mpu, "get_data_parallel_rank", default=dist.get_rank(dp_group))),
                  tp=int(_mpu_call(mpu, "get_tensor_model_parallel_rank", "get_model_parallel_rank", default=0)))

    def wrap(group: Any, size: int, name: str) -> CommGroup:
        return CommGroup.single(logger, name) if size == 1 or group is None else CommGroup(group, logger, name=name)

    world = CommGroup(None, logger, name="world")
    tp = wrap(tp_group, tp_size, "tp")
    pp = wrap(pp_group, pp_size, "pp")
    mp_group = _mpu_call(mpu, "get_model_parallel_group") if pp_size > 1 else tp_group
    mp = wrap(mp_group, pp_size * tp_size, "model_parallel")
    dp = CommGroup(dp_group, logger, name="dp")
    return Topology.from_groups(dims, dist.get_rank(), world, dp, tp, pp, mp, coord=coord)


def build_topology(config: dict[str, Any], model: Any = None, mpu: Any = None, mesh_param: Any = None) -> Topology:
    """The process grid for this run (collective: every rank calls it). A ``PipelineModule`` built its grid
    at construction: that grid is used, checked against the config."""
    import torch.distributed as dist

    from deepshard.pipe.grid import PipelineParallelGrid

    if isinstance(mpu, PipelineParallelGrid):  # e.g. mpu=net.mpu()
        mpu = mpu.grid_topology
    built = getattr(model, "grid_topology", None) if mpu is None else None
    if isinstance(built, Topology):
        return _module_grid(model, built, config, mesh_param)
    if isinstance(mpu, Topology):  # a grid the caller built first (a model written with deepshard.tp layers)
        if mesh_param is not None:
            raise ConfigError("pass mpu= or mesh_param=, not both: each describes the whole grid")
        return mpu
    carried = getattr(mpu, "deepshard_topology", None)  # deepshard.sp's mpu: the grid it built
    if isinstance(carried, Topology):
        if mesh_param is not None:
            raise ConfigError("pass mpu= or mesh_param=, not both: each describes the whole grid")
        sp = config.get("sequence_parallel_size") or 1
        if sp not in (1, carried.dims.sp):
            raise ConfigError(f"sequence_parallel_size is {sp} but the mpu from register_with_transformers was "
                              f"made for sequence_parallel_size={carried.dims.sp}; make them equal")
        return carried
    logger = CommsLogger()
    if mpu is not None:
        if mesh_param is not None:
            raise ConfigError("pass mpu= or mesh_param=, not both: each describes the whole grid")
        return topology_from_mpu(mpu, logger)
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return Topology.build(dims_from_config(config, world_size, model, mesh_param), logger)


def _module_grid(model: Any, built: Topology, config: dict[str, Any], mesh_param: Any) -> Topology:
    """The grid a ``PipelineModule`` built for itself, when the config agrees; a module built from
    ``num_stages`` alone takes the config's tensor-parallel split (a new grid, the same stages)."""
    import torch.distributed as dist

    wanted = dims_from_config(config, dist.get_world_size(), model, mesh_param)
    if wanted == built.dims:
        return built
    if model.grid_was_given or wanted.pp != built.dims.pp:
        raise ConfigError(f"the PipelineModule was built on {built.dims} but the config asks for {wanted}; build "
                          "the module with topology= the grid the config describes, or change the config")
    topology = Topology.build(wanted, built.world.logger)
    model.adopt_topology(topology)
    return topology
