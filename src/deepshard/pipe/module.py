"""``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``: DeepSpeed's ``deepspeed.pipe`` model description.

A pipeline model is a flat list of layers run as ``x = layer(x)``. Each process builds only the layers of
its own stage: a ``LayerSpec`` is a recipe (class and arguments) built where it is needed, so a 20-layer
model is never built whole on every process (parameter counts for partitioning come from a build on the
``meta`` device, which allocates nothing). Layers given as built modules are kept only on their stage.

``num_chunks`` (deepshard extension, Megatron's virtual pipeline size) cuts the model into
``num_stages * num_chunks`` virtual stages; virtual stage ``vs`` lives on stage ``vs % num_stages`` as its
chunk ``vs // num_stages``, for the interleaved 1F1B schedule (``pipeline.schedule: "interleaved"``).

``TiedLayerSpec(key, ...)`` layers share one module per stage per key (e.g. the embedding that also
serves as the output head); the pipeline engine makes the copies equal at start and sums their gradients
over the stages that hold them.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from deepshard.pipe.grid import PipelineParallelGrid, ProcessTopology, build_grid, dims_of, process_topology
from deepshard.pipe.partition import PartitionError, measure_layer_costs, parts_for
from deepshard.topology import ParallelDims, Topology


class LayerSpec:
    """A layer to build later, on its own stage only: ``LayerSpec(nn.Linear, 16, 16)``."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec needs an nn.Module subclass, got {typename!r}; wrap plain functions "
                            "as a layer callable in the layers list instead")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        """Construct the module."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose ``tied_weight_attr`` parameters are shared by every use of ``key`` (on any stage).
    ``forward_fn(module, x)``, when given, replaces ``module(x)`` (e.g. logits from an embedding)."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable | None = None,
                 tied_weight_attr: str | Sequence[str] = ("weight",), **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__})"


LayerEntry = Any  # nn.Module | LayerSpec | TiedLayerSpec | Callable


class PipelineModule(nn.Module):
    """The layers of one pipeline stage of a model described as a list of layers.

    ``num_stages`` (must divide the world size: the rest is data parallelism) or ``topology`` (DeepSpeed's
    ``ProcessTopology``, or a deepshard ``ParallelDims`` / ``Topology``) fixes the stage count; this
    process's stage comes from its rank (pipeline-major order), and the module builds its grid then, as
    DeepSpeed's does (``mpu()``, ``topology()``). ``stage_id`` (deepshard extension) picks the stage explicitly,
    e.g. to build one stage in a test with no process group. ``partition_method``: ``parameters``
    (default), ``uniform``, ``type:<regex>``, ``profile`` (times each layer on ``partition_sample``).
    ``num_chunks``: model chunks per stage (interleaved schedule); ``forward(x, chunk=c)`` runs chunk ``c``.

    Why the constructor is a collective: DeepSpeed's ``PipelineModule`` creates its process groups here, and
    scripts written for it call ``module.mpu()`` / ``module.topology()`` before ``deepspeed.initialize``
    (Megatron-DeepSpeed passes ``mpu=model.mpu()``). Building the groups later would break them; every rank
    constructs the module, as DeepSpeed requires too. ``initialize`` trains on these groups (``grid.py``
    checks them against the config).
    """

    def __init__(self, layers: Sequence[LayerEntry], num_stages: int | None = None, topology: Any = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters",
                 activation_checkpoint_interval: int = 0, activation_checkpoint_func: Callable | None = None,
                 checkpointable_layers: Sequence[str] | None = None, dynamic_shape: bool = False,
                 stage_id: int | None = None, partition_sample: Any = None, num_chunks: int = 1) -> None:
        super().__init__()
        self._layer_specs = list(layers)
        if not self._layer_specs:
            raise PartitionError("PipelineModule needs at least one layer")
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = list(checkpointable_layers) if checkpointable_layers else None
        self._checkpointable: tuple[Any, list[list[bool]]] = (None, [])
        """(the interval and layer filter they were computed for, each chunk's per-block decisions)."""
        self.dynamic_shape = dynamic_shape
        self.partition_method = partition_method
        grid_dims = None if topology is None else dims_of(topology)
        self.num_stages, self.stage_id = _resolve_stage(num_stages, grid_dims, stage_id)
        self._grid: PipelineParallelGrid | None = None
        """DeepSpeed's ``mpu``: built here, as DeepSpeed's module does, whenever a process group exists and
        the stage comes from the rank (``stage_id`` not given); ``initialize`` trains on its groups."""
        self._grid_given = topology is not None
        self._dims = grid_dims or ParallelDims(pp=self.num_stages)
        if stage_id is None and _distributed():
            self._grid = build_grid(self.num_stages, topology)
            self._dims, self.stage_id = self._grid.grid_topology.dims, self._grid.stage_id
        if not isinstance(num_chunks, int) or num_chunks < 1:
            raise ValueError(f"num_chunks={num_chunks!r}: give the model chunks per stage, an integer >= 1")
        if num_chunks > 1 and self.num_stages < 2:
            raise ValueError(f"num_chunks={num_chunks} interleaves chunks over stages and needs num_stages >= 2 "
                             f"(got {self.num_stages}); use num_chunks=1")
        self.num_chunks = num_chunks
        self.parts = parts_for(partition_method, len(self._layer_specs), self.num_stages * num_chunks,
                               self._param_counts, self._class_names, self._measured(partition_sample))
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.chunk_funcs: list[list[Callable]] = []
        """This stage's layers, one list per chunk (chunk ``c`` is virtual stage ``c * num_stages + stage``)."""
        self._build_local()
        self.forward_funcs: list[Callable] = [f for funcs in self.chunk_funcs for f in funcs]

    # ------------------------------------------------------------------------------ construction
    def _param_counts(self) -> list[int]:
        counts = []
        for entry in self._layer_specs:
            if isinstance(entry, nn.Module):
                counts.append(sum(p.numel() for p in entry.parameters() if p.requires_grad))
            elif isinstance(entry, LayerSpec):
                state = torch.get_rng_state()
                with torch.device("meta"):
                    module = entry.build()
                torch.set_rng_state(state)
                counts.append(sum(p.numel() for p in module.parameters() if p.requires_grad))
            else:
                counts.append(0)
        return counts

    def _class_names(self) -> list[str]:
        names = []
        for entry in self._layer_specs:
            cls = entry.typename if isinstance(entry, LayerSpec) else type(entry)
            names.append(getattr(cls, "__name__", type(entry).__name__))
        return names

    def _measured(self, sample: Any) -> Callable[[], list[float]] | None:
        if sample is None:
            return None
        builders = [(lambda e=e: e.build() if isinstance(e, LayerSpec) else e) for e in self._layer_specs]
        return lambda: measure_layer_costs(builders, sample)

    def _build_local(self) -> None:
        for chunk in range(self.num_chunks):
            virtual = chunk * self.num_stages + self.stage_id
            self.chunk_funcs.append([self._build_layer(i) for i in range(self.parts[virtual], self.parts[virtual + 1])])

    def _build_layer(self, index: int) -> Callable:
        """Layer ``index`` built (seeded by its index when ``seed_layers``) and registered; its forward."""
        entry = self._layer_specs[index]
        if isinstance(entry, (LayerSpec, nn.Module)) and self.seed_layers:
            (self.seed_fn or torch.manual_seed)(self.base_seed + index)
        if isinstance(entry, TiedLayerSpec):
            if entry.key not in self.tied_modules:
                self.tied_modules[entry.key] = entry.build()
                self.tied_weight_attrs[entry.key] = entry.tied_weight_attr
            return _TiedCall(self.tied_modules, entry.key, entry.forward_fn)
        if isinstance(entry, LayerSpec):
            module = entry.build()
            self.add_module(str(index), module)
            return module
        if isinstance(entry, nn.Module):
            self.add_module(str(index), entry)
            return entry
        if callable(entry):
            return entry
        raise TypeError(f"layer {index} is {type(entry).__name__}: use an nn.Module, a LayerSpec, a "
                        "TiedLayerSpec or a callable")

    # ------------------------------------------------------------------------------------ forward
    def forward(self, x: Any, chunk: int = 0) -> Any:
        """Run this stage's layers of ``chunk`` (blocks of ``activation_checkpoint_interval`` layers
        recomputed in backward when they qualify)."""
        funcs = self.chunk_funcs[chunk]
        interval = self.activation_checkpoint_interval
        if interval <= 0 or not self.training:
            return _run(funcs, x)
        decisions = self.checkpointable_blocks()[chunk]
        for start, checkpointed in zip(range(0, len(funcs), interval), decisions):
            block = funcs[start:start + interval]
            if checkpointed:
                fn = self.activation_checkpoint_func or _default_checkpoint
                x = fn(lambda *a, b=block: _run(b, a[0] if len(a) == 1 else a), *_as_tuple(x))
            else:
                x = _run(block, x)
        return x

    def checkpointable_blocks(self) -> list[list[bool]]:
        """For each chunk, whether each block of ``activation_checkpoint_interval`` layers is recomputed in
        backward (a block qualifies when it holds parameters, or, with ``checkpointable_layers``, when every
        layer's class is listed). Computed once per interval and cached: ``forward`` reads it on every call;
        empty lists while the interval is 0."""
        key = (self.activation_checkpoint_interval, tuple(self.checkpointable_layers or ()) or None)
        if self._checkpointable[0] != key:
            interval = key[0]
            blocks = [[self._checkpointable_block(funcs[i:i + interval]) for i in range(0, len(funcs), interval)]
                      if interval > 0 else [] for funcs in self.chunk_funcs]
            self._checkpointable = (key, blocks)
        return self._checkpointable[1]

    @property
    def is_checkpointable_results(self) -> list[bool]:
        """DeepSpeed's name: ``checkpointable_blocks()`` of this stage's layers, chunk after chunk."""
        return [decision for chunk in self.checkpointable_blocks() for decision in chunk]

    def _precompute_checkpointable_values(self) -> None:
        """DeepSpeed's name of ``checkpointable_blocks()`` computed ahead of ``forward``."""
        self.checkpointable_blocks()

    def _checkpointable_block(self, block: list[Callable]) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in block)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in block)

    def checkpoints_reentrant(self) -> bool:
        """Whether this module's blocks are recomputed by a reentrant function, which needs the first stage's
        inputs to require grad (else the first block is cut off from autograd and its parameters get no
        gradient). False while the interval is 0 and for deepshard's own functions (non-reentrant); a
        function of your own is assumed reentrant, as DeepSpeed assumes, so the pipeline engine marks the
        first stage's inputs as needing a gradient."""
        if self.activation_checkpoint_interval <= 0:
            return False
        return not _is_non_reentrant(self.activation_checkpoint_func)

    # ------------------------------------------------------------------------- DeepSpeed methods
    def partitions(self) -> list[int]:
        """Virtual-stage boundaries (the stages themselves when ``num_chunks`` is 1): virtual stage ``vs``
        holds layers ``parts[vs]:parts[vs + 1]``."""
        return list(self.parts)

    def stage_owner(self, layer_idx: int) -> int:
        """The stage that holds layer ``layer_idx``."""
        if not 0 <= layer_idx < len(self._layer_specs):
            raise IndexError(f"layer {layer_idx} is outside 0..{len(self._layer_specs) - 1}")
        for virtual in range(self.num_stages * self.num_chunks):
            if self.parts[virtual] <= layer_idx < self.parts[virtual + 1]:
                return virtual % self.num_stages
        raise AssertionError("unreachable: parts cover every layer")

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def topology(self) -> ProcessTopology:
        """DeepSpeed's ``ProcessTopology`` of the grid (axes ``pipe``, ``data`` and, with tensor
        parallelism, ``model``)."""
        return self._grid.topology() if self._grid is not None else process_topology(self._dims)

    def mpu(self) -> PipelineParallelGrid | None:
        """DeepSpeed's grid (``get_data_parallel_rank()``, ``get_pipe_parallel_group()``, ...); None only for
        a module built with an explicit ``stage_id`` outside a process group."""
        return self._grid

    @property
    def grid_topology(self) -> Topology | None:
        """The deepshard ``Topology`` this module's grid holds (what ``initialize`` trains on)."""
        return None if self._grid is None else self._grid.grid_topology

    def adopt_topology(self, topology: Topology) -> None:
        """Train on ``topology`` (``initialize``'s grid): it must give this process the stage it was built
        for. A module whose grid came from ``num_stages`` alone takes the config's tensor/data split here."""
        if topology.dims.pp != self.num_stages or topology.coord.pp != self.stage_id:
            raise ValueError(f"the training grid {topology.dims} puts this rank on stage {topology.coord.pp} of "
                             f"{topology.dims.pp}, but the PipelineModule built stage {self.stage_id} of "
                             f"{self.num_stages}; build the module with topology= that grid")
        self._grid, self._dims = PipelineParallelGrid(topology), topology.dims

    @property
    def grid_was_given(self) -> bool:
        """True when the module was built with an explicit ``topology=`` (its split is the user's)."""
        return self._grid_given

    def set_checkpoint_interval(self, interval: int) -> None:
        """Recompute blocks of ``interval`` layers in backward from the next ``forward`` on (0: none)."""
        if int(interval) < 0:
            raise ValueError(f"set_checkpoint_interval({interval}): give a block size >= 1, or 0 for no "
                             "activation checkpointing")
        self.activation_checkpoint_interval = int(interval)
        self.checkpointable_blocks()

    def get_additional_losses(self) -> Any:
        return None

    def pipeline_state_keys(self) -> set[str]:
        """The state-dict keys of the whole model, every stage's (built on the ``meta`` device): what a
        checkpoint of this model may hold besides this stage's own keys."""
        keys: set[str] = set()
        state = torch.get_rng_state()
        for index, entry in enumerate(self._layer_specs):
            if isinstance(entry, LayerSpec):
                with torch.device("meta"):
                    module = entry.build()
                prefix = f"tied_modules.{entry.key}." if isinstance(entry, TiedLayerSpec) else f"{index}."
            elif isinstance(entry, nn.Module):
                module, prefix = entry, f"{index}."
            else:
                continue
            keys.update(prefix + k for k in module.state_dict())
        torch.set_rng_state(state)
        return keys

    def tied_stages(self) -> dict[str, list[int]]:
        """Each tied key and the stages holding a copy of it (the same on every process)."""
        out: dict[str, list[int]] = {}
        for index, entry in enumerate(self._layer_specs):
            if isinstance(entry, TiedLayerSpec):
                stage = self.stage_owner(index)
                if stage not in out.setdefault(entry.key, []):
                    out[entry.key].append(stage)
        return out

    def tied_parameters(self, key: str) -> list[nn.Parameter]:
        """This stage's tied parameters of ``key`` (empty when the stage holds no copy)."""
        if key not in self.tied_modules:
            return []
        module = self.tied_modules[key]
        return [getattr(module, attr) for attr in self.tied_weight_attrs[key]]


class _TiedCall:
    """A tied layer's forward: ``forward_fn(module, x)`` or ``module(x)``; looks the module up each call."""

    def __init__(self, modules: nn.ModuleDict, key: str, forward_fn: Callable | None) -> None:
        self.modules, self.key, self.forward_fn = modules, key, forward_fn

    def __call__(self, x: Any) -> Any:
        module = self.modules[self.key]
        return self.forward_fn(module, x) if self.forward_fn is not None else module(x)


def _run(funcs: Sequence[Callable], x: Any) -> Any:
    for f in funcs:
        x = f(x)
    return x


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, tuple) else (x,)


def _default_checkpoint(fn: Callable, *args: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    return checkpoint(fn, *args, use_reentrant=False)


def _is_non_reentrant(func: Callable | None) -> bool:
    """Whether ``func`` (or the function a ``functools.partial`` wraps) is one of deepshard's recompute
    functions, all non-reentrant; None is the module's default (non-reentrant too)."""
    from functools import partial

    from deepshard.checkpointing import checkpoint, non_reentrant_checkpoint

    while isinstance(func, partial):
        func = func.func
    return func is None or func in (_default_checkpoint, checkpoint, non_reentrant_checkpoint)


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _resolve_stage(num_stages: int | None, topology: ParallelDims | None, stage_id: int | None) -> tuple[int, int]:
    """``(num_stages, this process's stage)`` from the arguments and the process group."""
    import torch.distributed as dist

    initialized = _distributed()
    rank, world = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)
    if stage_id is None and not initialized and (num_stages or (topology.pp if topology is not None else 1)) > 1:
        raise ValueError("a multi-stage PipelineModule needs torch.distributed initialized (call "
                         "deepshard.init_distributed() first) or stage_id=<stage to build>")
    if topology is not None:
        dims = topology
        if num_stages is not None and num_stages != dims.pp:
            raise ValueError(f"num_stages={num_stages} disagrees with topology pp={dims.pp}; give one of them")
        num_stages = dims.pp
        default_stage = dims.coord(rank).pp if dims.world_size == world else 0
    elif num_stages is None:
        raise ValueError("PipelineModule needs num_stages=<pipeline stages> or topology=<ParallelDims>")
    else:
        if num_stages < 1 or (world % num_stages != 0 and stage_id is None):
            raise ValueError(f"num_stages={num_stages} must divide the world size {world} (the rest is data "
                             f"parallelism); launch a multiple of {num_stages} processes")
        default_stage = rank // max(1, world // num_stages) if world % num_stages == 0 else 0
    stage = default_stage if stage_id is None else int(stage_id)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage_id={stage} is outside 0..{num_stages - 1}")
    return num_stages, stage
