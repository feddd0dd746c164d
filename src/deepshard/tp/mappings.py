"""The conjugate communication operators of tensor parallelism, as autograd functions.

Megatron-LM (Shoeybi et al. 2019, section 3) names two operators that bracket every tensor-parallel
region: ``f`` is the identity forward and an all-reduce backward (it enters a region whose ranks each
hold a different slice of the weights), ``g`` is the all-reduce forward and the identity backward (it
leaves the region). Each is the other's conjugate: what one does forward the other does backward.

With sequence parallelism (Korthikanti et al. 2022, section 4.2) the activations outside the region
are split along the sequence: ``f`` becomes an all-gather along the sequence (backward: reduce-scatter)
and ``g`` a reduce-scatter (backward: all-gather). The volume is the same as the two all-reduces, but
the norms and dropouts between regions run on 1/t of the tokens.

Every function takes the tensor-parallel ``CommGroup`` explicitly (no global state); its traffic is
counted by that group's comms logger under the ``tp:`` labels when the group is named ``tp``
(``Topology.build`` names it so). A group of size 1 makes every operator the identity.
"""
from __future__ import annotations

from typing import Any

import torch

from deepshard.comm.group import CommGroup


# ------------------------------------------------------------------------------------- primitives
def _all_reduce(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """The sum of ``x`` over the group, in a fresh tensor (autograd inputs are never written)."""
    if group.size == 1:
        return x
    out = x.contiguous().clone()
    group.all_reduce(out)
    return out


def _split(x: torch.Tensor, group: CommGroup, dim: int) -> torch.Tensor:
    """This rank's equal slice of ``x`` along ``dim``."""
    if group.size == 1:
        return x
    size = x.shape[dim]
    if size % group.size != 0:
        raise ValueError(f"tensor parallel: dimension {dim} of size {size} does not split evenly over "
                         f"{group.size} ranks; make it a multiple of {group.size}")
    return x.narrow(dim, group.rank * (size // group.size), size // group.size).contiguous()


def _gather(x: torch.Tensor, group: CommGroup, dim: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order."""
    if group.size == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] * group.size, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    group.all_gather_into_tensor(out, moved)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, group: CommGroup, dim: int) -> torch.Tensor:
    """The sum of ``x`` over the group, of which this rank keeps its equal slice along ``dim``."""
    if group.size == 1:
        return x
    if x.shape[dim] % group.size != 0:
        raise ValueError(f"sequence parallel: dimension {dim} of size {x.shape[dim]} does not split evenly "
                         f"over {group.size} ranks; make the sequence length a multiple of {group.size}")
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // group.size, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    group.reduce_scatter_tensor(out, moved)
    return out.movedim(0, dim)


# -------------------------------------------------------------------------------- autograd functions
class _CopyToRegion(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _conjugate_pair(name: str, forward_op: Any, backward_op: Any, doc: str) -> type:
    """An autograd function whose forward is ``forward_op(x, group, dim)`` and whose backward is its
    conjugate ``backward_op(grad, group, dim)`` (the four slice/gather/reduce-scatter regions differ
    only in that pair)."""

    def forward(ctx: Any, x: torch.Tensor, group: CommGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return forward_op(x, group, dim)

    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return backward_op(grad, ctx.group, ctx.dim), None, None

    return type(name, (torch.autograd.Function,),
                {"__doc__": doc, "forward": staticmethod(forward), "backward": staticmethod(backward)})


_ScatterToRegion = _conjugate_pair("_ScatterToRegion", _split, _gather,
                                   "Keep this rank's slice forward; all-gather the slices' gradients backward.")
_GatherFromRegion = _conjugate_pair("_GatherFromRegion", _gather, _split,
                                    "All-gather the slices forward; keep this rank's slice of the gradient backward.")
_SequenceGather = _conjugate_pair("_SequenceGather", _gather, _reduce_scatter,
                                  "Sequence-parallel ``f``: all-gather along the sequence forward, reduce-scatter "
                                  "backward.")
_SequenceReduceScatter = _conjugate_pair("_SequenceReduceScatter", _reduce_scatter, _gather,
                                         "Sequence-parallel ``g``: reduce-scatter along the sequence forward, "
                                         "all-gather backward.")


# ------------------------------------------------------------------------------------ public API
def copy_to_tp_region(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """``f``: enter a tensor-parallel region (identity forward, all-reduce of the gradient backward).

    Applied to a parameter, it sums that parameter's gradient over the group: what a replicated
    parameter used on different data per rank (a norm under sequence parallelism) needs."""
    return x if group.size == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """``g``: leave a tensor-parallel region (all-reduce forward, identity backward)."""
    return x if group.size == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: CommGroup, dim: int = -1) -> torch.Tensor:
    """Keep this rank's slice of ``x`` along ``dim`` (backward: all-gather)."""
    return x if group.size == 1 else _ScatterToRegion.apply(x, group, dim)


def gather_from_tp_region(x: torch.Tensor, group: CommGroup, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's slice along ``dim`` (backward: keep this rank's slice)."""
    return x if group.size == 1 else _GatherFromRegion.apply(x, group, dim)


def gather_from_sequence_parallel(x: torch.Tensor, group: CommGroup, dim: int = 1) -> torch.Tensor:
    """Sequence-parallel ``f``: all-gather the sequence shards along ``dim`` (backward: reduce-scatter)."""
    return x if group.size == 1 else _SequenceGather.apply(x, group, dim)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: CommGroup, dim: int = 1) -> torch.Tensor:
    """Sequence-parallel ``g``: sum over the group and keep this rank's sequence shard along ``dim``
    (backward: all-gather)."""
    return x if group.size == 1 else _SequenceReduceScatter.apply(x, group, dim)


def scatter_to_sequence_parallel(x: torch.Tensor, group: CommGroup, dim: int = 1) -> torch.Tensor:
    """Enter the sequence-parallel part of a model: keep this rank's sequence shard (backward:
    all-gather). Used once, after the embedding, when the embedding itself is not vocab-parallel."""
    return scatter_to_tp_region(x, group, dim)
