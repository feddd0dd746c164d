"""The flat, bucketed, sharded layout of the trainable parameters used by ZeRO stages 1 and 2.

Parameters (in reverse registration order, roughly the order backward produces their gradients) are
packed into buckets of about ``reduce_bucket_size`` elements. Each bucket is zero-padded to a multiple of
the data-parallel size N and split into N equal chunks: rank r owns chunk r of *every* bucket. A bucket's
gradient is then reduced with one reduce-scatter that leaves each rank exactly its chunk, and its
parameters are rebuilt with one all-gather of the chunks, with no uneven splits and no transient
full-size buffer (the same idea as FSDP's per-group flat sharding).

A rank's *shard* is its chunks of all buckets, laid end to end (``shard_numel`` elements). The part of
one parameter that falls in one rank's chunk is a *fragment*: the unit the optimizer updates and the
checkpoint stores (by parameter name and element offset, so any process count can load it).

Experts split over expert-parallel ranks are sharded over their expert-data-parallel group instead of the
data-parallel group: such parameters belong to another *domain* (``domains``), whose buckets are cut into
that group's size of chunks, rank ``r`` of the group owning chunk ``r``. Buckets never mix domains.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bucket:
    index: int
    start: int       # offset of the bucket in the padded flat space
    numel: int       # elements of parameters in the bucket
    padded: int      # numel rounded up to a multiple of the world size
    world: int
    rank: int = 0    # this rank's place in the bucket's domain (the group it is sharded over)
    domain: int = 0  # which domain (0: the data-parallel group; others: expert-data-parallel groups)

    @property
    def chunk(self) -> int:
        return self.padded // self.world

    def owned(self, rank: int | None = None) -> tuple[int, int]:
        """[begin, end) of ``rank``'s chunk in the flat space (default: this rank's)."""
        begin = self.start + (self.rank if rank is None else rank) * self.chunk
        return begin, begin + self.chunk


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in the flat space."""

    name: str
    param_index: int
    bucket: int
    flat_start: int
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Fragment:
    """The part ``[start, start + numel)`` of parameter ``name`` (flattened) that this rank owns."""

    name: str
    slot: int          # index into FlatLayout.slots
    start: int         # element offset inside the parameter
    numel: int
    flat_start: int    # offset in the flat space
    shard_start: int   # offset in this rank's shard


class FlatLayout:
    """Buckets, slots and this rank's fragments for ``params`` (given in launch order)."""

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], bucket_elements: int,
                 world: int, rank: int, groups: list[list[int]] | None = None,
                 shapes: list[tuple[int, ...]] | None = None, domains: list[int] | None = None,
                 domain_shapes: list[tuple[int, int]] | None = None) -> None:
        """``groups`` (lists of indices into ``params``) fixes the buckets explicitly (ZeRO-3 gathers one
        module's parameters together); otherwise parameters are packed up to ``bucket_elements``.
        ``shapes`` overrides the parameters' own shapes (ZeRO-3 parameters are empty while sharded).
        ``domains[i]``: the domain of parameter ``i`` (default 0), ``domain_shapes[d]``: ``(world, rank)``
        of domain ``d`` (domain 0 is ``(world, rank)``)."""
        if bucket_elements <= 0:
            raise ValueError(f"reduce_bucket_size ({bucket_elements}) must be a positive number of elements")
        self.world, self.rank = world, rank
        self.domains = domains if domains is not None else [0] * len(params)
        self.domain_shapes = [(world, rank)] + list(domain_shapes or [])[1:]
        self.shapes = shapes if shapes is not None else [tuple(p.shape) for p in params]
        self.numels = [_numel(s) for s in self.shapes]
        self.buckets: list[Bucket] = []
        self.slots: list[Slot] = []
        if groups is None:
            groups, members, size = [], [], 0
            for i in range(len(params)):
                crossing = members and self.domains[i] != self.domains[members[0]]
                if members and (size + self.numels[i] > bucket_elements or crossing):
                    groups.append(members)
                    members, size = [], 0
                members.append(i)
                size += self.numels[i]
            if members:
                groups.append(members)
        start = 0
        for members in groups:
            start = self._close_bucket(start, members, names)
        self.total = sum(b.padded for b in self.buckets)
        self.shard_numel = sum(b.chunk for b in self.buckets)
        self._shard_offsets = []
        off = 0
        for b in self.buckets:
            self._shard_offsets.append(off)
            off += b.chunk
        self.fragments = self._fragments()

    def _close_bucket(self, start: int, members: list[int], names: list[str]) -> int:
        numel = sum(self.numels[j] for j in members)
        domain = self.domains[members[0]]
        if any(self.domains[j] != domain for j in members):
            raise ValueError(f"a bucket mixes parameters of domains {sorted({self.domains[j] for j in members})}: "
                             "experts split over expert-parallel ranks must be bucketed apart from the rest")
        world, rank = self.domain_shapes[domain]
        padded = max(-(-numel // world) * world, world)
        bucket = Bucket(len(self.buckets), start, numel, padded, world, rank, domain)
        offset = start
        for j in members:
            self.slots.append(Slot(names[j], j, bucket.index, offset, self.numels[j], tuple(self.shapes[j])))
            offset += self.numels[j]
        self.buckets.append(bucket)
        return start + padded

    def shard_offset(self, bucket: Bucket) -> int:
        return self._shard_offsets[bucket.index]

    def _fragments(self) -> list[Fragment]:
        out = []
        for s_index, slot in enumerate(self.slots):
            bucket = self.buckets[slot.bucket]
            lo, hi = bucket.owned()
            begin, end = max(lo, slot.flat_start), min(hi, slot.flat_start + slot.numel)
            if begin < end:
                out.append(Fragment(slot.name, s_index, begin - slot.flat_start, end - begin, begin,
                                    self.shard_offset(bucket) + (begin - lo)))
        return out

    def owned_ranges(self) -> list[tuple[int, int, int]]:
        """(flat_begin, flat_end, shard_begin) of each owned chunk."""
        return [(*b.owned(), self.shard_offset(b)) for b in self.buckets]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
