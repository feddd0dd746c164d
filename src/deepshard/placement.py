"""Where a parameter lives, recorded on the parameter itself (no process-global registry): THE record.

A ``Placement`` says which strategy manages a parameter (weakly: the parameter never keeps an engine
alive), how it is split across tensor-parallel ranks (dim, index, parts, Megatron's stride or fused
parts), which pipeline stages hold a tied copy, and how many model-parallel ranks hold a copy of it.
The gradient norm, clipping, the fp16 overflow check, checkpoint save/load, the 16-bit save, the fp32
consolidation and ``deepshard.utils.safe_get_full_*`` read only this record. Megatron's and DeepSpeed's
attributes (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``) on a user's own layers
are adopted into it at ``initialize`` (:func:`adopt_megatron_attributes`); deepshard's own layers write
both. ``engine.destroy()`` removes the ownership, so two engines in one process never see each other's
parameters.

An expert of a mixture-of-experts layer split over expert-parallel ranks (``deepshard.moe``) records which
expert-parallel group holds it (:class:`ExpertShard`): its gradient is reduced, and its ZeRO state
sharded, over that group's expert-data-parallel ranks instead of all data-parallel replicas, and
checkpoints store it under its layer's global expert id.

The copy count is what makes the global gradient norm count a parameter once: every model-parallel rank
adds ``|g|^2 / copies`` of each parameter it holds, and the sum over the model-parallel group is then the
norm of the model's gradient whether a parameter is split over tensor-parallel ranks (1 copy of each
part), replicated over them (``tp`` copies) or tied across pipeline stages (one copy per stage).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

ATTR = "_deepshard_placement"


@dataclass
class TensorSplit:
    """A tensor-parallel part: ``index`` of ``parts`` equal slices along ``dim`` of the global tensor."""

    dim: int
    index: int
    parts: int
    fused: Optional[tuple[int, ...]] = None
    """A fused matrix (qkv, gate_up) split part by part: the parts' global sizes along ``dim``; the
    slice is then ``index`` of each part, concatenated (``deepshard.tp.params.shard_of``)."""


@dataclass(frozen=True)
class ExpertShard:
    """A parameter of one expert of a layer split over ``ep_size`` > 1 expert-parallel ranks."""

    group: str
    """``ep_size_<P>``: the expert-parallel group (``Topology.experts``) whose expert-data-parallel ranks
    hold the same expert."""
    saved_name: str
    """The parameter's name with its layer's *global* expert id (``...deepspeed_experts.<G>...``): the name
    checkpoints store it under, the same for every layout."""
    every_name: tuple[str, ...] = ()
    """The same parameter's saved name in each of the layer's experts (other ranks hold the rest): what a
    checkpoint of the whole model holds for it."""
    offset: int = 0
    """Where the parameter starts in the flattened tensor it is saved as (AutoEP: this rank's experts of a
    fused ``[E, ...]`` parameter); 0 for a whole tensor."""
    global_shape: Optional[tuple[int, ...]] = None
    """The shape of the tensor it is saved as, when it is a slice of it (None: its own shape)."""


@dataclass
class Placement:
    owner: Optional["weakref.ref[object]"] = None
    """The strategy that manages the parameter, held weakly. This module sits below ``zero/``, ``tp/`` and
    ``checkpoint/`` and names none of them: ``deepshard.zero.strategy.owner_of`` gives it its type."""
    split: Optional[TensorSplit] = None
    copies: int = 1
    """Model-parallel ranks holding this same value (replicated over tp, tied across pp stages)."""
    tied_stages: int = 1
    """Pipeline stages holding a tied copy (set by the pipeline module)."""
    expert: Optional[ExpertShard] = None
    """Set for an expert's parameter under expert parallelism (``deepshard.moe.parallel``)."""


def placement_of(param: torch.Tensor) -> Optional[Placement]:
    """``param``'s record, or None when nothing was recorded about it yet."""
    found = getattr(param, ATTR, None)
    return found if isinstance(found, Placement) else None


def record_of(param: torch.Tensor) -> Placement:
    """``param``'s record, created empty on first use (what every writer below calls)."""
    found = placement_of(param)
    if found is None:
        found = Placement()
        setattr(param, ATTR, found)
    return found


def owner_of(param: torch.Tensor) -> Optional[object]:
    """The strategy that manages ``param``, if any (None once its engine was destroyed). Typed callers go
    through ``deepshard.zero.strategy.owner_of``."""
    found = placement_of(param)
    if found is None or found.owner is None:
        return None
    return found.owner()


def claim(params: Any, strategy: object) -> None:
    """Record ``strategy`` as the manager of ``params``."""
    ref = weakref.ref(strategy)
    for p in params:
        record_of(p).owner = ref


def release(params: Any, strategy: object) -> None:
    """Forget ``strategy``'s ownership of ``params`` (the split and copy counts stay: they describe the
    model, not the engine)."""
    for p in params:
        found = placement_of(p)
        if found is not None and found.owner is not None and found.owner() in (strategy, None):
            found.owner = None


def mark_split(param: torch.Tensor, dim: int, index: int, parts: int,
               fused: Optional[tuple[int, ...]] = None) -> None:
    """Declare ``param`` the ``index``-th of ``parts`` tensor-parallel slices along ``dim`` (of each
    of the ``fused`` parts, when given)."""
    record_of(param).split = TensorSplit(dim, index, parts, fused)


def mark_tied(param: torch.Tensor, stages: int) -> None:
    """Declare ``param`` held (tied) by ``stages`` pipeline stages."""
    record_of(param).tied_stages = int(stages)


def mark_expert(param: torch.Tensor, group: str, saved_name: str, every_name: tuple[str, ...] = (), offset: int = 0,
                global_shape: Optional[tuple[int, ...]] = None) -> None:
    """Declare ``param`` an expert's, held by the expert-parallel group ``group``, saved as ``saved_name``
    (``every_name``: its names in every expert of its layer; ``offset`` / ``global_shape``: the slice of a
    larger saved tensor it is)."""
    record_of(param).expert = ExpertShard(group, saved_name, tuple(every_name), int(offset), global_shape)


def saved_names(module: torch.nn.Module) -> dict[str, str]:
    """State-dict name -> the name a checkpoint stores it under, where they differ: the parameters of
    experts split over expert-parallel ranks (their global expert id)."""
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        stored = saved_name(p, name)
        if stored != name:
            out[name] = stored
    return out


def saved_slice(param: torch.Tensor) -> tuple[int, Optional[tuple[int, ...]]]:
    """``(offset, shape)`` of the saved tensor ``param`` is a slice of: ``(0, None)`` for a whole tensor."""
    found = expert_of(param)
    return (0, None) if found is None else (found.offset, found.global_shape)


def local_part(value: torch.Tensor, param: torch.Tensor, shape: Optional[tuple[int, ...]] = None) -> torch.Tensor:
    """``param``'s own part of a saved (whole) tensor ``value``, of ``param``'s shape (or ``shape``: a ZeRO-3
    parameter's full shape while it is sharded)."""
    offset, whole = saved_slice(param)
    if whole is None:
        return value
    shape = tuple(param.shape) if shape is None else tuple(shape)
    numel = int(torch.Size(shape).numel())
    return value.reshape(-1)[offset:offset + numel].view(shape)


def saved_name(param: torch.Tensor, name: str) -> str:
    """The name checkpoints store ``param`` (called ``name`` in its module) under: its global expert name
    for an expert split over expert-parallel ranks, else ``name``."""
    found = placement_of(param)
    return name if found is None or found.expert is None else found.expert.saved_name


def expert_of(param: torch.Tensor) -> Optional[ExpertShard]:
    """``param``'s expert record (None: a dense parameter, or an expert every rank holds)."""
    found = placement_of(param)
    return None if found is None else found.expert


def identities(param: torch.Tensor, name: str) -> set[str]:
    """The names a checkpoint may list ``param`` (saved as ``name``) under in its optimizer groups: ``name``,
    and for an expert its name in every expert of its layer (the writer may have held other experts)."""
    found = expert_of(param)
    return {name} | (set(found.every_name) if found is not None else set())


def split_of(param: torch.Tensor) -> Optional[TensorSplit]:
    found = placement_of(param)
    return None if found is None else found.split


def adopt_megatron_attributes(params: Any, tp_rank: int, tp_size: int) -> int:
    """Record, for each parameter Megatron-style code marked ``tensor_model_parallel = True`` (with
    ``partition_dim`` and ``partition_stride``) and that has no split yet, this rank's slice: index
    ``tp_rank`` of ``tp_size`` along ``partition_dim``. Megatron's stride ``s`` cuts the full dimension
    into ``s * tp_size`` chunks of which rank ``r`` holds ``r, r + tp_size, ...``: ``s`` equal fused parts
    split part by part. Returns how many parameters were adopted."""
    adopted = 0
    for p in params:
        if not getattr(p, "tensor_model_parallel", False) or split_of(p) is not None:
            continue
        dim = getattr(p, "partition_dim", None)
        if not isinstance(dim, int) or not -p.dim() <= dim < p.dim():
            raise ValueError(f"a parameter of shape {tuple(p.shape)} is marked tensor_model_parallel=True with "
                             f"partition_dim={dim!r}: set partition_dim to the dimension it is split along")
        dim %= p.dim()
        stride = int(getattr(p, "partition_stride", 1) or 1)
        if p.shape[dim] % stride != 0:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} has partition_stride={stride}, which does not "
                             f"divide its partition_dim={dim} size {p.shape[dim]}")
        fused = None if stride == 1 else (p.shape[dim] * tp_size // stride,) * stride
        mark_split(p, dim, tp_rank, tp_size, fused=fused)
        adopted += 1
    return adopted


def set_copies(params: Any, tp_size: int) -> None:
    """Fill each parameter's copy count for a grid with ``tp_size`` tensor-parallel ranks."""
    for p in params:
        found = record_of(p)
        found.copies = (1 if found.split is not None else tp_size) * found.tied_stages


def norm_weight(param: torch.Tensor) -> float:
    """``1 / copies``: the share of ``|grad|^2`` this rank adds to the global norm."""
    found = placement_of(param)
    return 1.0 if found is None else 1.0 / found.copies
