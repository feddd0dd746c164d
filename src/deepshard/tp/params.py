"""How a parameter records its tensor-parallel split: in its placement record (``placement.py``, what
the gradient norm and the checkpoints read), and, for code written for Megatron and DeepSpeed (e.g.
DeepSpeed's ``is_model_parallel_parameter``), in their attribute names too (``tensor_model_parallel``,
``partition_dim``, ``partition_stride``). ``tp_fused_parts`` records a fused matrix (qkv, gate_up) split part by part:
the sizes of its parts along ``partition_dim`` in the full tensor, so the full tensor can be rebuilt.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def mark_tp_split(param: torch.nn.Parameter, dim: int, index: int, size: int,
                  parts: Optional[Sequence[int]] = None) -> None:
    """Record that ``param`` is slice ``index`` of ``size`` along ``dim`` (of each of ``parts``, when
    fused), on the parameter's attributes and on its placement (the norm and the checkpoints read it)."""
    from deepshard.placement import mark_split

    fused = tuple(parts) if parts else None
    for name, value in (("tensor_model_parallel", True), ("partition_dim", dim), ("partition_stride", 1),
                        ("tp_fused_parts", fused)):
        setattr(param, name, value)  # Megatron's and DeepSpeed's attribute names, read by their code
    mark_split(param, dim, index, size, fused=fused)


def mark_sequence_parallel(param: torch.nn.Parameter) -> None:
    """Record that ``param`` is replicated but sees one sequence shard per rank (its gradient is summed
    over the tensor-parallel group by ``copy_to_tp_region`` in the forward)."""
    setattr(param, "sequence_parallel", True)  # Megatron's attribute name


def is_tp_split(param: torch.Tensor) -> bool:
    """True for a parameter each tensor-parallel rank holds a different slice of (its placement record:
    deepshard's layers record it, Megatron-style attributes are adopted at ``initialize``)."""
    from deepshard.placement import split_of

    return split_of(param) is not None


def tp_split_dim(param: torch.Tensor) -> Optional[int]:
    """The dimension ``param`` is split along, or None for a replicated parameter."""
    from deepshard.placement import split_of

    split = split_of(param)
    return None if split is None else split.dim


def shard_of(full: torch.Tensor, dim: int, rank: int, size: int,
             parts: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` along ``dim``: one equal slice of each part (the whole
    dimension is one part unless ``parts`` says otherwise), the parts' slices concatenated."""
    parts = list(parts) if parts else [full.shape[dim]]
    if sum(parts) != full.shape[dim]:
        raise ValueError(f"fused parts {parts} sum to {sum(parts)}, but dimension {dim} has {full.shape[dim]}")
    pieces, start = [], 0
    for part in parts:
        if part % size != 0:
            raise ValueError(f"a part of {part} along dimension {dim} does not split over {size} tensor-parallel "
                             f"ranks; choose a tensor-parallel size that divides {part}")
        step = part // size
        pieces.append(full.narrow(dim, start + rank * step, step))
        start += part
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]


def unshard(shards: Sequence[torch.Tensor], dim: int, parts: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The full tensor from every rank's slice (rank order): the inverse of ``shard_of``."""
    size = len(shards)
    if not parts:
        return torch.cat(list(shards), dim=dim)
    local = [p // size for p in parts]
    split = [s.split(local, dim=dim) for s in shards]
    return torch.cat([split[r][i] for i in range(len(parts)) for r in range(size)], dim=dim)
