"""Block-wise symmetric integer quantization of flat tensors, in PyTorch: what ZeRO++'s quantized weight
all-gather (qwZ, 8 bits) and quantized gradient reduce-scatter (qgZ, 4 or 8 bits) send instead of the
16/32-bit values (Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant
Model Training").

A tensor of ``numel`` elements is cut into blocks of ``block`` elements (the last one zero-padded); each
block is sent as ``bits``-bit integers ``q = round(x / s)`` in ``[-(2^(bits-1) - 1), 2^(bits-1) - 1]``
with one fp32 scale ``s = max|x| / (2^(bits-1) - 1)`` per block (symmetric, as DeepSpeed's quantizer).
4-bit values are packed two per byte. The integers and the scales travel as one byte tensor (the
*payload*: data bytes, then the scales' bytes), so a quantized collective is one collective of bytes.

Rounding is to the nearest integer, so a value comes back within ``s / 2`` of what was sent, and a block
of zeros comes back as zeros. Decoding computes in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_BYTES = 4  # one fp32 scale per block


@dataclass(frozen=True)
class BlockCodec:
    """The encoding of ``numel`` elements as ``bits``-bit integers in blocks of ``block`` elements."""

    numel: int
    block: int
    bits: int

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"quantization bits must be 4 or 8, got {self.bits}")
        if self.block < 2 or self.block % 2:
            raise ValueError(f"the quantization block must be an even number of elements >= 2, got {self.block}")
        if self.numel < 0:
            raise ValueError(f"cannot quantize {self.numel} elements")

    @classmethod
    def spread(cls, numel: int, max_block: int, bits: int) -> "BlockCodec":
        """Blocks of at most ``max_block`` elements, as equal as can be (an even size), so a tensor just
        over a block's size is not cut into one full block and one nearly empty one."""
        blocks = max(-(-numel // max_block), 1)
        size = -(-numel // blocks)
        return cls(numel, max(size + (size % 2), 2), bits)

    @property
    def blocks(self) -> int:
        return max(-(-self.numel // self.block), 1)

    @property
    def padded(self) -> int:
        return self.blocks * self.block

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def data_bytes(self) -> int:
        return self.padded * self.bits // 8

    @property
    def nbytes(self) -> int:
        """The payload's size: integers then scales."""
        return self.data_bytes + SCALE_BYTES * self.blocks

    def encode(self, values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The payload of the first ``numel`` elements of 1-D ``values`` (into ``out`` when given: a byte
        tensor of ``nbytes``)."""
        if values.dim() != 1 or values.numel() < self.numel:
            raise ValueError(f"encode needs a 1-D tensor of at least {self.numel} elements, got shape "
                             f"{tuple(values.shape)}")
        payload = out if out is not None else torch.empty(self.nbytes, dtype=torch.uint8, device=values.device)
        if payload.dtype != torch.uint8 or payload.numel() != self.nbytes:
            raise ValueError(f"the payload must be {self.nbytes} uint8 bytes, got {payload.numel()} {payload.dtype}")
        x = torch.zeros(self.padded, dtype=torch.float32, device=values.device)
        x[:self.numel] = values[:self.numel]
        x = x.view(self.blocks, self.block)
        scale = x.abs().amax(dim=1) / self.qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(x / scale[:, None]).clamp_(-self.qmax, self.qmax).to(torch.int8)
        data = payload[:self.data_bytes]
        if self.bits == 8:
            data.copy_(q.view(-1).view(torch.uint8))
        else:
            nibbles = (q.view(-1) + 8).to(torch.uint8).view(-1, 2)
            torch.bitwise_or(nibbles[:, 0], nibbles[:, 1] << 4, out=data)
        payload[self.data_bytes:].copy_(scale.view(torch.uint8))
        return payload

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """The ``numel`` values (fp32) a payload encodes."""
        if payload.dtype != torch.uint8 or payload.numel() != self.nbytes:
            raise ValueError(f"the payload must be {self.nbytes} uint8 bytes, got {payload.numel()} {payload.dtype}")
        data = payload[:self.data_bytes]
        scale = payload[self.data_bytes:].clone().view(torch.float32)
        if self.bits == 8:  # int8 x fp32 computes in fp32 in one pass (no fp32 copy of the integers first)
            q = data.view(torch.int8)
        else:
            q = torch.stack(((data & 0xF), (data >> 4)), dim=1).view(-1).to(torch.float32) - 8.0
        values = torch.mul(q.view(self.blocks, self.block), scale[:, None])
        return values.view(-1)[:self.numel]

    def decode_into(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        """Decode into ``out`` (``numel`` elements of any float dtype)."""
        out.copy_(self.decode(payload))

    def decode_add(self, payload: torch.Tensor, acc: torch.Tensor) -> None:
        """Add the decoded values into fp32 ``acc`` (the reduction of quantized gradients)."""
        acc.add_(self.decode(payload))
