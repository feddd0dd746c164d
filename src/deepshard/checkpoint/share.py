"""A rank's share of a checkpoint: the element ranges of each tensor its strategy loads.

A strategy that partitions the fp32 values and optimizer state (ZeRO 1-2) needs only the ranges it owns;
the rest of each parameter comes from its peers after the load (an all-gather). Handing the reader those
ranges (:class:`LoadShare`) lets it open only the rank files whose fragments overlap them: each rank reads
about 1/N of its stage's checkpoint instead of all of it, whatever the data-parallel size it was written at.

Ranges are offsets in the flattened tensor as the loading model holds it (its own tensor-parallel part).
A saved fragment of a tensor-parallel part maps onto them only when the checkpoint was cut the same way
(same dimension, part count and fused sizes); otherwise the whole tensor is read and cut afterwards, as a
load without a share does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

Span = tuple[int, int]
"""``[start, stop)`` in a flattened tensor."""


def _cut(split: Optional[Sequence[Any]]) -> Optional[tuple[int, int, tuple[int, ...]]]:
    """``(dim, parts, fused sizes)`` of a ``[dim, index, parts(, fused)]`` split record (None: not split)."""
    if not split:
        return None
    fused = tuple(int(s) for s in split[3]) if len(split) > 3 and split[3] else ()
    return int(split[0]), int(split[2]), fused


@dataclass
class LoadShare:
    """What one rank loads of each tensor: ``ranges[name]`` (saved names; an empty list: nothing of it) and
    the loading model's tensor-parallel ``splits`` (``name -> [dim, index, parts(, fused)]``). A name not in
    ``ranges`` is read whole."""

    ranges: dict[str, list[Span]]
    splits: dict[str, list[Any]] = field(default_factory=dict)
    rank: Optional[int] = None
    """The loading rank (global): its own rank file is read first, since a resume on the same grid finds its
    whole share there."""
    first_file: Optional[str] = None
    """The tensors file to read first instead (a load restoring optimizer state: the file the engine names
    as this rank's optimizer-state file, ``engine._get_optimizer_ckpt_name``)."""

    def restricts(self, name: str) -> bool:
        return name in self.ranges

    def needed(self, name: str, saved_split: Optional[Sequence[Any]]) -> Optional[list[Span]]:
        """The spans of saved part ``saved_split`` of ``name`` this rank needs: None for all of it (the name
        is not restricted, or the checkpoint's tensor-parallel cut differs from this model's), ``[]`` for none."""
        spans = self.ranges.get(name)
        if spans is None:
            return None
        mine = self.splits.get(name)
        if _cut(saved_split) != _cut(mine):
            return None
        if mine and saved_split and int(saved_split[1]) != int(mine[1]):
            return []  # another tensor-parallel rank's part
        return spans

    def wants(self, name: str, start: int, numel: int, saved_split: Optional[Sequence[Any]]) -> bool:
        """Whether the saved fragment ``[start, start + numel)`` of ``name`` holds elements this rank loads."""
        spans = self.needed(name, saved_split)
        return spans is None or any(a < start + numel and start < b for a, b in spans)


def uncovered(needed: list[Span], got: list[Span]) -> int:
    """How many elements of ``needed`` no span of ``got`` covers."""
    merged: list[Span] = []
    for a, b in sorted(got):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    missing = 0
    for a, b in needed:
        inside = sum(max(0, min(b, hi) - max(a, lo)) for lo, hi in merged)
        missing += (b - a) - inside
    return missing
