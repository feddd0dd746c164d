"""DeepSpeed's per-parameter and per-module ZeRO-3 attributes, on a model deepshard partitions.

Libraries written for DeepSpeed read them (TRL, OpenRLHF, PEFT, LLaVA-style ``maybe_zero_3``):

=========================  ===================================================================================
``param.ds_id``            a number, unique within the model (its position in ``named_parameters()``), the same
                           on every rank; code tests ``hasattr(p, "ds_id")`` to mean "a ZeRO-3 parameter"
``param.ds_status``        :class:`~deepshard.zero.stage3.param_status.ZeroParamStatus`, kept true on every
                           gather and release
``param.ds_shape``         the full shape (``param.shape`` is ``[0]`` while partitioned)
``param.ds_numel``         the full number of elements
``param.ds_tensor``        this rank's part of the values: a view into the shard (writes, and ``.data = t``, go to
                           the model: :class:`ShardView`). deepshard
                           partitions a module's parameters as one flat group, so a rank holds a contiguous
                           stretch of that group and a parameter's part may be of any length, 0 included (in
                           DeepSpeed every part has ``ceil(numel / world)`` elements); the parts of all ranks,
                           in rank order, are the parameter. Empty when the shard lives in a swap file that is
                           not mapped into memory (as DeepSpeed's is while swapped out to NVMe)
``param.ds_persist``       True for parameters kept gathered (``stage3_param_persistence_threshold``)
``param.all_gather()``     gather (``param_list=[...]``: those parameters; ``async_op=True``: returns a handle to
                           ``wait()``); the parameter stays gathered until a module's forward that uses it ends,
                           or ``param.partition()``
``param.partition()``      release the gathered values (unless a forward or ``GatheredParameters`` uses them)
``param.ds_active_sub_modules``  an empty set, kept for code that clears it (TRL); deepshard counts a group's users
                           itself
``param.ds_zero_placement_family``  ``"autoep_expert"`` for an expert's parameter (AutoEP's, or a ``MoE``
                           layer's: partitioned over its expert-data-parallel group), ``"replicated"`` for the
                           others (partitioned over the data-parallel group)
``param.ds_zero_partition_group_name``  the expert's ``ep_size_<P>`` group name; None for the others
``param.ds_zero_partition_world_size``, ``_rank``, ``_process_group``  the group it is partitioned over: its
                           size, this rank's place in it, its torch process group
``module.ds_id``           the module's position in ``module.modules()``
``module._external_params``  ``{id(param): param}`` registered with ``zero.register_external_parameter``;
``module.ds_external_parameters()``  returns its ``items()``, as in DeepSpeed
=========================  ===================================================================================

A gather or release acts on the parameter's whole group (the parameters its module owns directly): a
superset of what DeepSpeed moves, never less.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch

from deepshard.placement import expert_of
from deepshard.zero.stage3.group import ShardedGroup

EXTERNAL = "_external_params"


class ExternalParameters:
    """``module.ds_external_parameters()``: the ``(id, param)`` pairs registered on the module."""

    def __init__(self, registry: dict[int, torch.nn.Parameter]) -> None:
        self.registry = registry

    def __call__(self) -> Any:
        return self.registry.items()


def external_registry(module: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
    """The module's ``_external_params`` dict, created (with ``ds_external_parameters``) on first use."""
    registry = module.__dict__.get(EXTERNAL)
    if registry is None:
        registry = {}
        module.__dict__[EXTERNAL] = registry
        module.__dict__["ds_external_parameters"] = ExternalParameters(registry)
    return registry


def groups_of(params: Iterable[torch.nn.Parameter]) -> list[ShardedGroup]:
    """The distinct ZeRO-3 groups holding ``params`` (parameters no stage-3 strategy holds are skipped)."""
    from deepshard.zero.strategy import owner_of

    out: dict[int, ShardedGroup] = {}
    for p in params:
        strategy = owner_of(p)
        group = strategy.group_of(p) if strategy is not None and hasattr(strategy, "group_of") else None
        if group is not None:
            out.setdefault(id(group), group)
    return list(out.values())


class _Gathering:
    """What ``param.all_gather(async_op=True)`` returns: ``wait()`` finishes the gathers."""

    def __init__(self, groups: list[ShardedGroup]) -> None:
        self.groups = groups

    def wait(self, handle_dependency: bool = True) -> None:
        """Finish the gathers (``handle_dependency``: DeepSpeed's flag about autograd ordering of its own
        handles; accepted, nothing to order here)."""
        for g in self.groups:
            g.wait_for_unshard()


def gather(params: Iterable[torch.nn.Parameter], async_op: bool = False) -> _Gathering | None:
    """Gather the groups of ``params`` (every rank must call it for the same parameters)."""
    groups = groups_of(params)
    for g in groups:
        g.unshard(async_op=True)
    handle = _Gathering(groups)
    if async_op:
        return handle
    handle.wait()
    return None


def partition(params: Iterable[torch.nn.Parameter]) -> None:
    """Release the groups of ``params`` that nothing is using (a forward, ``GatheredParameters``)."""
    for g in groups_of(params):
        if g.users == 0:
            g.reshard(hand_over=True)


class ParamCall:
    """``param.all_gather`` / ``param.partition``: DeepSpeed's signatures; the parameter is held weakly so
    the attribute keeps nothing alive."""

    def __init__(self, param: torch.nn.Parameter, action: str) -> None:
        self._param = weakref.ref(param)
        self.action = action

    def __call__(self, param_list: Iterable[torch.nn.Parameter] | None = None, async_op: bool = False,
                 hierarchy: int = 0, **_: Any) -> _Gathering | None:
        own = self._param()
        params = list(param_list) if param_list is not None else ([own] if own is not None else [])
        if self.action == "all_gather":
            return gather(params, async_op=async_op)
        partition(params)
        return None


def fragments(group: ShardedGroup) -> list[tuple[int, int]]:
    """Per parameter of ``group``: the ``[lo, hi)`` range of this rank's chunk that holds part of it."""
    start, end = group.comm.rank * group.chunk, (group.comm.rank + 1) * group.chunk
    out, offset = [], 0
    for n in group.numels:
        lo, hi = max(offset, start), min(offset + n, end)
        out.append((lo - start, hi - start) if hi > lo else (0, 0))
        offset += n
    return out


_TENSOR_DATA = torch.Tensor.data


class ShardView(torch.Tensor):
    """``param.ds_tensor``: this rank's part of a parameter, a view of the engine's shard. Assigning ``.data``
    writes the values into the shard (in DeepSpeed ``ds_tensor`` is the partition itself, so
    ``p.ds_tensor.data = t`` changes what the next gather sees; a rebound view would change nothing). Every
    other operation on it returns a plain tensor."""

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        return _TENSOR_DATA.__get__(self).as_subclass(torch.Tensor)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if tuple(value.shape) != tuple(self.shape):
            raise ValueError(f"ds_tensor.data = a tensor of shape {tuple(value.shape)}: this rank's part of the "
                             f"parameter has shape {tuple(self.shape)}; the values are written into the ZeRO-3 "
                             "shard in place, so give a tensor of that shape")
        with torch.no_grad():
            _TENSOR_DATA.__get__(self).copy_(value)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = super().__torch_function__(func, types, args, kwargs or {})
        return result.as_subclass(torch.Tensor) if isinstance(result, ShardView) else result


def attach(module: torch.nn.Module, groups: list[ShardedGroup],
           chunk_view: Callable[[ShardedGroup], torch.Tensor | None]) -> None:
    """Put DeepSpeed's attributes (see the module docstring) on ``module``'s parameters and modules.
    ``chunk_view(group)`` is the group's chunk of this rank's shard where it is addressable, else None."""
    for i, (_, p) in enumerate(module.named_parameters()):
        p.__dict__["ds_id"] = i
    external: set[int] = set()
    for i, m in enumerate(module.modules()):
        m.__dict__["ds_id"] = i
        external.update(external_registry(m))
    for g in groups:
        view = chunk_view(g)
        if view is None:
            view = torch.empty(0, dtype=g.dtype, device=g.device)
        for p, (lo, hi) in zip(g.params, fragments(g)):
            attrs = p.__dict__
            attrs["ds_tensor"] = view[lo:hi].as_subclass(ShardView)
            attrs["ds_active_sub_modules"] = set()
            attrs["is_external_param"] = id(p) in external
            attrs["ds_process_group"] = g.comm.group
            _placement(attrs, p, g)
            attrs["all_gather"] = ParamCall(p, "all_gather")
            attrs["partition"] = ParamCall(p, "partition")


def _placement(attrs: dict[str, Any], param: torch.nn.Parameter, group: ShardedGroup) -> None:
    """The ``ds_zero_*`` placement record of a partitioned parameter: where its group is sharded."""
    shard = expert_of(param)
    attrs["ds_zero_placement_family"] = "replicated" if shard is None else "autoep_expert"
    attrs["ds_zero_partition_group_name"] = None if shard is None else shard.group
    attrs["ds_zero_partition_process_group"] = group.comm.group
    attrs["ds_zero_partition_rank"] = group.comm.rank
    attrs["ds_zero_partition_world_size"] = group.comm.size


def detach(module: torch.nn.Module) -> None:
    """Remove the per-parameter calls (``engine.destroy()``): they act through the engine's strategy."""
    for p in module.parameters():
        for name in ("all_gather", "partition"):
            p.__dict__.pop(name, None)
