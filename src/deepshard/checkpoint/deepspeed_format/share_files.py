"""Which data-parallel ranks' optimizer files of a DeepSpeed tag hold what one loading rank needs.

A strategy that partitions its state (ZeRO 1-3) loads only its own ranges of each parameter
(``checkpoint/share.py``: :class:`LoadShare`); the rest it takes from its peers. DeepSpeed's optimizer
files are one per data-parallel rank, each holding that rank's partition of every flat group, so a rank
needs only the files whose partitions overlap its ranges: on the grid that saved the tag, its own file.

Where each rank's partition lies follows from the layout (``flat.py``):

* ZeRO-3: every parameter is cut into ``ceil(numel / dp)`` pieces; rank ``r`` holds piece ``r`` of each
  (``param_shapes`` and the data-parallel size say where).
* ZeRO 1-2: a group's parameters lie back to back (each followed by its alignment padding) in one flat
  vector cut into ``dp`` equal partitions; the partition size is read from any one rank's file.

The files not read stand in as zeros of their partitions' sizes (:func:`zeros_like_file`): the values a
rank loads never come from them.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import torch

from deepshard.checkpoint.deepspeed_format.flat import numel_of
from deepshard.checkpoint.share import LoadShare, Span


def _overlaps(spans: Optional[list[Span]], lo: int, hi: int) -> bool:
    """Whether ``[lo, hi)`` of a tensor holds elements of ``spans`` (None: the whole tensor is needed)."""
    if hi <= lo:
        return False
    return spans is None or any(a < hi and lo < b for a, b in spans)


def zero3_ranks(share: LoadShare, shapes_groups: Sequence[Mapping[str, Sequence[int]]], dp: int) -> set[int]:
    """The ranks whose ZeRO-3 files hold a piece of a parameter ``share`` needs."""
    needed: set[int] = set()
    for shapes in shapes_groups:
        for name, shape in shapes.items():
            n = numel_of(shape)
            piece = math.ceil(n / dp)
            spans = share.needed(name, None)
            needed.update(r for r in range(dp) if _overlaps(spans, r * piece, min((r + 1) * piece, n)))
    return needed


def zero12_ranks(share: LoadShare, shapes_groups: Sequence[Mapping[str, Sequence[int]]], dp: int,
                 sizes: Sequence[int], paddings: Optional[Sequence[Sequence[int]]]) -> set[int]:
    """The ranks whose ZeRO 1-2 files hold part of a parameter ``share`` needs; ``sizes[g]``: the partition
    size of group ``g`` (equal on every rank), ``paddings[g]``: each parameter's alignment padding."""
    needed: set[int] = set()
    for g, shapes in enumerate(shapes_groups):
        size, offset = int(sizes[g]), 0
        for i, (name, shape) in enumerate(shapes.items()):
            n = numel_of(shape)
            spans = share.needed(name, None)
            for r in range(dp):  # the part of [offset, offset + n) in rank r's partition, as offsets in the tensor
                lo, hi = max(offset, r * size), min(offset + n, (r + 1) * size)
                shifted = None if spans is None else [(a + offset, b + offset) for a, b in spans]
                if _overlaps(shifted, lo, hi):
                    needed.add(r)
            offset += n + (int(paddings[g][i]) if paddings else 0)
    return needed


def estimated_sizes(shapes_groups: Sequence[Mapping[str, Sequence[int]]], dp: int) -> list[int]:
    """ZeRO 1-2 partition sizes as DeepSpeed cuts a group without per-parameter alignment padding (padded to a
    multiple of ``2 * dp``): which file to read first; that file's own sizes then decide the rest."""
    return [math.ceil(max(sum(numel_of(s) for s in shapes.values()), 1) / (2 * dp)) * 2 for shapes in shapes_groups]


def zeros_like_file(osd: dict[str, Any], stage: int) -> dict[str, Any]:
    """A stand-in for an optimizer file not read: ``osd``'s flat groups and elementwise states as zeros
    (the same sizes: every rank's partitions are), its scalars as they are."""
    def zeros(value: Any) -> Any:
        return torch.zeros_like(value) if torch.is_tensor(value) and value.dim() > 0 else value

    flat_key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    base_key = "optimizer_state_dict" if stage == 3 else "base_optimizer_state"
    base = osd[base_key]
    state = {g: {k: zeros(v) for k, v in s.items()} for g, s in base["state"].items()}
    return {**osd, flat_key: [zeros(t) for t in osd[flat_key]], base_key: {**base, "state": state}}
