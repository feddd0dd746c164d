"""DeepSpeed's flat fp32 partitions <-> whole tensors by name.

ZeRO 1-2: a parameter group is one flat vector, the group's parameters back to back in ``param_shapes``
order (each followed by its alignment padding, ``param_alignment_paddings``), padded at the end to a
multiple of the data-parallel size and cut into equal consecutive partitions, one per rank.

ZeRO-3: every parameter is cut on its own into ``ceil(numel / dp)``-element pieces (the last padded);
rank ``r``'s flat group is its piece of each parameter, back to back in ``param_shapes`` order.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from deepshard.checkpoint.io import CheckpointError


def numel_of(shape: Sequence[int]) -> int:
    return int(math.prod(int(d) for d in shape))


def split_zero12(partitions: list[torch.Tensor], shapes: Mapping[str, Sequence[int]],
                 paddings: Sequence[int] | None, where: str) -> dict[str, torch.Tensor]:
    """Whole flat tensors by name from one group's per-rank partitions (ZeRO 1-2)."""
    flat = torch.cat([p.reshape(-1) for p in partitions])
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for i, (name, shape) in enumerate(shapes.items()):
        n = numel_of(shape)
        if offset + n > flat.numel():
            raise CheckpointError(f"{where}: the flat partitions hold {flat.numel()} elements but parameter '{name}' "
                                  f"needs [{offset}, {offset + n}); a rank file is missing or from another run")
        out[name] = flat[offset:offset + n].clone()
        offset += n + (int(paddings[i]) if paddings else 0)
    return out


def join_zero12(values: Mapping[str, torch.Tensor], shapes: Mapping[str, Sequence[int]], dp: int,
                align: int) -> tuple[list[torch.Tensor], int]:
    """One group's per-rank partitions (ZeRO 1-2) and the group's end padding; the whole group is padded
    to a multiple of ``align * dp`` elements."""
    parts = [values[name].reshape(-1).float() for name in shapes]
    flat = torch.cat(parts) if parts else torch.zeros(0)
    total = math.ceil(max(flat.numel(), 1) / (align * dp)) * align * dp
    padding = total - flat.numel()
    flat = torch.cat([flat, flat.new_zeros(padding)])
    size = total // dp
    return [flat[r * size:(r + 1) * size].clone() for r in range(dp)], padding


def split_zero3(rank_flats: list[torch.Tensor], shapes: Mapping[str, Sequence[int]], where: str
                ) -> dict[str, torch.Tensor]:
    """Whole flat tensors by name from one group's per-rank flat vectors (ZeRO-3)."""
    dp = len(rank_flats)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in shapes.items():
        n = numel_of(shape)
        piece = math.ceil(n / dp)
        if any(offset + piece > f.numel() for f in rank_flats):
            raise CheckpointError(f"{where}: a rank's flat group is too short for parameter '{name}' "
                                  f"(needs [{offset}, {offset + piece})); the files are from another run")
        out[name] = torch.cat([f.reshape(-1)[offset:offset + piece] for f in rank_flats])[:n].clone()
        offset += piece
    return out


def join_zero3(values: Mapping[str, torch.Tensor], shapes: Mapping[str, Sequence[int]], dp: int
               ) -> list[torch.Tensor]:
    """One group's per-rank flat vectors (ZeRO-3)."""
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(dp)]
    for name, shape in shapes.items():
        n = numel_of(shape)
        piece = math.ceil(n / dp)
        flat = values[name].reshape(-1).float()
        flat = torch.cat([flat, flat.new_zeros(piece * dp - n)])
        for r in range(dp):
            per_rank[r].append(flat[r * piece:(r + 1) * piece])
    return [torch.cat(p).clone() if p else torch.zeros(0) for p in per_rank]
