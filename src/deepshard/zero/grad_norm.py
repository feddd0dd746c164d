"""The global gradient norm, with the same bits however the gradient is split: over ranks (ZeRO stage,
data-parallel size, shard boundaries), over tensors, and over host and disk.

A floating-point sum depends on its order, and each ZeRO stage holds the gradient cut differently
(stage 0 whole, stages 1-2 in bucket chunks, stage 3 in module-group chunks), so summing squares the
plain way gives each stage another norm, another clipping factor and, after a few steps, other
weights. Here every squared element becomes an integer on one grid, and integers add exactly in any
order:

1. ``M``: the largest ``|g|`` over the whole gradient (a max is exact in any order; one small
   all-reduce agrees on it). ``M = 0`` gives 0; an inf or nan anywhere gives inf.
2. ``k``: a power of two such that ``|g| * 2^k < 2^21`` for every element.
3. each element contributes ``trunc(fp32((g * 2^k)^2))``, an integer below ``2^42``: the squared value
   rounded to fp32 (as any fp32 norm squares it) and cut to whole units of ``2^-2k``, i.e. to
   ``2^-42`` of the largest square. Up to ``2^21`` of them sum exactly in int64 (chunks of ``2^16``
   summed on the device, read back every ``2^20`` elements); those sums add up as Python integers.
4. the ranks' integers are summed exactly (an int64 all-reduce of 30-bit limbs), and the norm is
   ``sqrt(total * 2^-2k)``, computed once from that integer.

The result differs from an fp32 sum of squares by far less than that sum's own round-off (an element
loses under ``2^-42`` of the largest square). Model parallelism weighs each element by
``1 / copies`` of its parameter (a replicated parameter counts once): the integers are kept per number
of copies and the division is done exactly on the totals.

Cost: a read of the gradient for the max, then per element a scale, a square, a conversion to int64
and an int64 sum, into two ``2^16``-element buffers (at most 768 KiB) that live only for the norm's
duration (kept between steps at up to ``2^20`` elements, they raised every stage's measured peak).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from deepshard.comm.group import CommGroup

MAX_BITS = 21
"""``|g| * 2^k < 2^MAX_BITS``: squares stay below ``2^42``, so ``2^20`` of them fit an int64 sum."""
CHUNK = 1 << 16
"""Elements per pass through the scratch buffers (12 bytes each, alive only during the norm)."""
FLUSH = 1 << 20
"""Chunk sums are added on the device and read back once per ``FLUSH`` elements: fewer than ``2^21``
elements below ``2^42`` each sum below ``2^63``."""
LIMB_BITS = 30
LIMBS = 5
"""Totals travel as ``LIMBS`` limbs of ``LIMB_BITS`` bits (up to ``2^150``: ``2^42`` per element, room for
``2^100`` elements); each limb's sum over ranks stays far below ``2^63``."""

Pieces = Callable[[], Iterable[torch.Tensor]]
"""Yields this rank's gradient tensors (any shape, any float dtype); called once per pass."""


@dataclass
class NormScratch:
    """Reused buffers for the integer pass (one fp32 and one int64 tensor of at most ``CHUNK`` elements)."""

    values: torch.Tensor | None = None
    integers: torch.Tensor | None = None
    _devices: dict[str, int] = field(default_factory=dict)

    def take(self, numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        size = min(CHUNK, max(numel, 1))
        if self.values is None or self.values.device != device or self.values.numel() < size:
            self.values = torch.empty(size, dtype=torch.float32, device=device)
            self.integers = torch.empty(size, dtype=torch.int64, device=device)
        assert self.integers is not None
        return self.values[:numel], self.integers[:numel]

    def release(self) -> None:
        """Free the buffers (after a norm: they are not kept between steps, so no step's peak holds them)."""
        self.values = self.integers = None


def local_max(sources: Sequence[Pieces], device: torch.device) -> torch.Tensor:
    """The largest ``|g|`` over every tensor of ``sources`` (fp32, 1 element; inf when any element is
    inf or nan)."""
    best = torch.zeros(1, dtype=torch.float32, device=device)
    for pieces in sources:
        for t in pieces():
            if t.numel() == 0:
                continue
            lo, hi = torch.aminmax(t.detach().reshape(-1))
            best = torch.maximum(best, torch.maximum(-lo.float(), hi.float()).reshape(1).to(device))
    return torch.nan_to_num(best, nan=math.inf, posinf=math.inf)


def scale_exponent(max_abs: float) -> int:
    """``k`` with ``max_abs * 2^k < 2^MAX_BITS`` (``max_abs`` finite and positive)."""
    return MAX_BITS - math.frexp(max_abs)[1]


def square_units(pieces: Pieces, k: int, scratch: NormScratch) -> int:
    """``sum(trunc(fp32((g * 2^k)^2)))`` over the tensors of ``pieces``, exactly."""
    total = 0
    pending: torch.Tensor | None = None  # int64 sum on the device of the chunks not yet read back
    count = 0  # elements in ``pending``: below FLUSH + CHUNK < 2^21
    scale = math.ldexp(1.0, k)
    for t in pieces():
        flat = t.detach().reshape(-1)
        for lo in range(0, flat.numel(), CHUNK):
            chunk = flat[lo:lo + CHUNK]
            values, integers = scratch.take(chunk.numel(), chunk.device)
            values.copy_(chunk)
            values.mul_(scale).square_()
            integers.copy_(values)  # toward zero: a whole number of units, below 2^42 each
            part = integers.sum()
            pending = part if pending is None else pending.add_(part)
            count += chunk.numel()
            if count >= FLUSH:
                total += int(pending.item())
                pending, count = None, 0
    if pending is not None:
        total += int(pending.item())
    return total


def encode(totals: Sequence[int], device: torch.device) -> torch.Tensor:
    """Non-negative integers as int64 limbs (``LIMBS`` each), for an exact sum over ranks."""
    out = torch.zeros(len(totals) * LIMBS, dtype=torch.int64)
    mask = (1 << LIMB_BITS) - 1
    for i, value in enumerate(totals):
        if value < 0 or value >> (LIMB_BITS * LIMBS):
            raise OverflowError(f"gradient square sum {value} does not fit {LIMBS} limbs of {LIMB_BITS} bits")
        for j in range(LIMBS):
            out[i * LIMBS + j] = (value >> (LIMB_BITS * j)) & mask
    return out.to(device)


def decode(limbs: torch.Tensor) -> list[int]:
    """The integers ``encode`` wrote (after their limbs were summed over ranks)."""
    values = [int(v) for v in limbs.cpu().tolist()]
    return [sum(values[i + j] << (LIMB_BITS * j) for j in range(LIMBS)) for i in range(0, len(values), LIMBS)]


def exact_norm(sources: dict[int, Sequence[Pieces]], groups: Sequence[CommGroup], device: torch.device,
               scratch: NormScratch, copies_max: int = 1, divisor: int = 1) -> float:
    """The L2 norm of the gradient whose local parts are ``sources`` (keyed by how many ranks hold a
    copy of each part: 1, or up to ``copies_max`` under model parallelism), summed over ``groups`` in
    order (a collective on each; every rank passes the same keys' range and groups), divided by
    ``divisor`` under the root (a mean over ranks). inf when any element is inf or nan."""
    everything = [p for ps in sources.values() for p in ps]
    peak = local_max(everything, device)
    for g in groups:
        g.all_reduce_control(peak, "all_reduce of the gradient's largest element", op="max", label="all_reduce(max)")
    m = float(peak.item())
    if not math.isfinite(m):
        return math.inf
    if m == 0.0:
        return 0.0
    k = scale_exponent(m)
    try:
        totals = [sum(square_units(p, k, scratch) for p in sources.get(c, ())) for c in range(1, copies_max + 1)]
    finally:
        scratch.release()
    if groups:
        limbs = encode(totals, device)
        for g in groups:
            g.all_reduce_control(limbs, "all_reduce of the gradient norm", label="all_reduce(scalar)")
        totals = decode(limbs)
    # sum(t_c / c) / divisor, exactly: over the common denominator lcm(1..copies_max) x divisor, then one
    # correctly rounded integer division (no ``fractions``: its import of ``decimal`` costs zero.Init's memory)
    common = math.lcm(*range(1, copies_max + 1))
    numerator = sum(t * (common // c) for c, t in zip(range(1, copies_max + 1), totals))
    return math.sqrt(math.ldexp(numerator / (common * divisor), -2 * k))
