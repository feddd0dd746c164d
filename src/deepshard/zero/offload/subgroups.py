"""Sub-groups: the units an offloaded optimizer steps through, one at a time.

A rank's shard (its chunks of every bucket, end to end) is cut into consecutive ranges of at most
``sub_group_size`` elements (DeepSpeed's ``zero_optimization.sub_group_size``). Fragments (the parts of
parameters the rank owns, see ``zero.partition``) that straddle a cut are split there into *pieces*, so
every piece lies in exactly one sub-group and a sub-group's master weights and optimizer states are
contiguous ranges of the shard: one read and one write per tensor. A piece is a ``Fragment`` like any
other (name, offset inside the parameter, flat and shard offsets), so checkpoints store pieces exactly
as they store fragments.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from deepshard.zero.partition import Fragment


@dataclass(frozen=True)
class SubGroup:
    """Shard range ``[start, end)`` holding pieces ``[first, last)`` (indices into the piece list)."""

    index: int
    start: int
    end: int
    first: int
    last: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def pieces(self) -> range:
        return range(self.first, self.last)


def split_fragments(fragments: list[Fragment], size: int) -> list[Fragment]:
    """``fragments`` (in shard order) cut at every multiple of ``size`` in shard space."""
    if size < 1:
        raise ValueError(f"zero_optimization.sub_group_size ({size}) must be a positive number of elements")
    out: list[Fragment] = []
    for f in sorted(fragments, key=lambda x: x.shard_start):
        begin, end = f.shard_start, f.shard_start + f.numel
        while begin < end:
            cut = min(end, (begin // size + 1) * size)
            k = begin - f.shard_start
            out.append(replace(f, start=f.start + k, numel=cut - begin, flat_start=f.flat_start + k,
                               shard_start=begin))
            begin = cut
    return out


def plan_subgroups(pieces: list[Fragment], size: int) -> list[SubGroup]:
    """Sub-groups over ``pieces`` (already split by ``split_fragments`` with the same ``size``); each
    covers only the shard range its pieces use, so padding is never read or written."""
    groups: list[SubGroup] = []
    i = 0
    while i < len(pieces):
        key = pieces[i].shard_start // size
        j = i
        while j < len(pieces) and pieces[j].shard_start // size == key:
            j += 1
        start = pieces[i].shard_start
        end = max(p.shard_start + p.numel for p in pieces[i:j])
        groups.append(SubGroup(len(groups), start, end, i, j))
        i = j
    return groups
