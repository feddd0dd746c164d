"""1-bit compression with error feedback: the math, with no process group.

A tensor ``x`` is sent as its signs (one bit per element, packed eight to a byte) and one scale per
segment, ``||x_seg||_2 / sqrt(n_seg)``, so that the decompressed ``sign(x) * scale`` has the same L2
norm as ``x``. What compression loses, ``x - decompress(compress(x))``, is kept by the sender and added
to what it sends next time (error feedback): the error does not accumulate, it is delayed, which is why
1-bit Adam converges like Adam (Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale
Training with Adam's Convergence Speed", arXiv 2102.02888, Algorithm 1).

The tensors to exchange (one per parameter) are laid out in an ``(N, C)`` matrix for an ``N``-rank
group (:class:`ExchangeLayout`): each tensor is zero-padded to a multiple of ``8 * N`` elements and
split into ``N`` equal pieces, piece ``r`` going to row ``r`` (the part rank ``r`` reduces). Every
(row, tensor) cell gets its own scale, so a layer of small values is not flattened by a layer of large
ones. Padding never reaches a scale or an error: masks zero it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Bit ``j`` of byte ``k`` of each row is 1 where ``x[..., 8k + j] >= 0``. ``x``: ``(R, C)``, ``C`` a
    multiple of 8; returns ``(R, C // 8)`` uint8."""
    rows, columns = x.shape
    if columns % 8:
        raise ValueError(f"pack_signs: {columns} columns is not a multiple of 8 (the layout pads to it)")
    bits = (x >= 0).to(torch.uint8).reshape(rows, columns // 8, 8)
    return (bits * _BIT_WEIGHTS.to(x.device)).sum(dim=-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of :func:`pack_signs`: ``(R, B)`` uint8 -> ``(R, 8B)`` of +1 / -1."""
    rows, nbytes = packed.shape
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(rows, nbytes * 8).to(dtype) * 2 - 1


@dataclass
class ExchangeLayout:
    """Where each of a list of tensors lives in the ``(world, columns)`` exchange matrix."""

    numels: list[int]
    world: int
    widths: list[int] = field(init=False)
    """Columns per tensor: ``ceil(numel / (8 * world)) * 8``."""
    segment_ids: torch.Tensor = field(init=False)
    """``(columns,)``: the tensor each column belongs to."""
    mask: torch.Tensor = field(init=False)
    """``(world, columns)`` float: 1 on real elements, 0 on padding."""

    def __post_init__(self) -> None:
        if self.world < 1 or not self.numels:
            raise ValueError(f"ExchangeLayout needs a world >= 1 and tensors, got {self.world} and {self.numels}")
        step = 8 * self.world
        self.widths = [-(-n // step) * 8 for n in self.numels]
        ids = [torch.full((w,), i, dtype=torch.long) for i, w in enumerate(self.widths)]
        self.segment_ids = torch.cat(ids)
        pieces = []
        for n, w in zip(self.numels, self.widths):
            real = torch.zeros(self.world * w)
            real[:n] = 1.0
            pieces.append(real.view(self.world, w))
        self.mask = torch.cat(pieces, dim=1)

    @property
    def segments(self) -> int:
        return len(self.numels)

    @property
    def columns(self) -> int:
        return sum(self.widths)

    def to_matrix(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The tensors (flattened, zero-padded) as the ``(world, columns)`` fp32 matrix."""
        pieces = []
        for t, w in zip(tensors, self.widths):
            flat = torch.zeros(self.world * w, dtype=torch.float32, device=t.device)
            flat[:t.numel()] = t.reshape(-1)
            pieces.append(flat.view(self.world, w))
        return torch.cat(pieces, dim=1)

    def from_matrix(self, matrix: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """Copy the matrix back into ``tensors`` (padding dropped)."""
        start = 0
        for t, w in zip(tensors, self.widths):
            block = matrix[:, start:start + w].reshape(-1)[:t.numel()]
            t.copy_(block.view_as(t))
            start += w

    def counts(self, device: torch.device) -> torch.Tensor:
        """``(world, segments)``: real elements of each tensor in each row."""
        return self.segment_sum(self.mask.to(device))

    def segment_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``(R, columns) -> (R, segments)``: the sum over each tensor's columns."""
        out = torch.zeros(values.shape[0], self.segments, dtype=values.dtype, device=values.device)
        return out.index_add_(1, self.segment_ids.to(values.device), values)


@dataclass
class Compressed:
    """One compressed ``(R, C)`` block: packed signs ``(R, C // 8)`` and scales ``(R, segments)``."""

    signs: torch.Tensor
    scales: torch.Tensor

    def to_bytes(self) -> torch.Tensor:
        """``(R, C // 8 + 4 * segments)`` uint8: what goes on the wire (one message per row)."""
        return torch.cat([self.signs, self.scales.float().contiguous().view(torch.uint8)], dim=1)

    @staticmethod
    def from_bytes(wire: torch.Tensor, columns: int) -> "Compressed":
        nbytes = columns // 8
        return Compressed(wire[:, :nbytes], wire[:, nbytes:].contiguous().view(torch.float32))


def compress(x: torch.Tensor, layout: ExchangeLayout, mask: torch.Tensor, counts: torch.Tensor
             ) -> tuple[Compressed, torch.Tensor]:
    """Compress ``x`` (``(R, C)``, padding already zero) per (row, tensor); returns the message and the
    new error ``x - decompress(message)`` (zero on padding). ``mask``/``counts``: the rows' part of
    ``layout.mask`` / ``layout.counts``."""
    scales = (layout.segment_sum(x * x) / counts.clamp(min=1)).sqrt()
    message = Compressed(pack_signs(x), scales)
    error = (x - decompress(message, layout)) * mask
    return message, error


def decompress(message: Compressed, layout: ExchangeLayout) -> torch.Tensor:
    """``sign * scale`` as an ``(R, C)`` fp32 matrix (padding columns hold values: mask them)."""
    per_column = message.scales.float().index_select(1, layout.segment_ids.to(message.scales.device))
    return unpack_signs(message.signs) * per_column
