"""Dropout whose mask belongs to the token, not to the rank: the same mask for a token at global position
``t`` whatever the sequence-parallel layout (and in one process).

``torch.nn.Dropout`` on a rank's slice draws from that rank's generator in the slice's order: with the same
seed on every rank, sp ranks draw the same stream for different tokens, and the mask of a token depends on
how the sequence was cut. Here the mask is drawn in blocks of ``BLOCK`` positions, each block from a
generator seeded by (call seed, block index); a rank draws only the blocks its tokens fall in. The call seed
is one draw from torch's default generator, the same on every rank that was seeded alike (and in one
process), so consecutive calls differ.
"""
from __future__ import annotations

import torch

BLOCK = 256
"""Positions per independently seeded block of the mask."""


def positional_dropout(x: torch.Tensor, p: float, positions: torch.Tensor, training: bool = True,
                       dim: int = 1) -> torch.Tensor:
    """``x`` with dropout ``p``; ``positions`` are the global positions of ``x``'s tokens along ``dim``."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    seed = int(torch.randint(0, 1 << 40, (1,)))  # every rank draws it: the default generators stay in step
    if not training or p == 0.0:
        return x
    if positions.dim() != 1 or positions.numel() != x.shape[dim]:
        raise ValueError(f"positions must be 1-D with one entry per token along dim {dim} of {tuple(x.shape)}")
    moved = x.movedim(dim, 0)  # [tokens, ...]
    keep = torch.empty(moved.shape, dtype=torch.bool, device=x.device)
    positions = positions.to(x.device)
    blocks = torch.div(positions, BLOCK, rounding_mode="floor")
    for block in torch.unique(blocks).tolist():
        gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + int(block))
        draw = torch.rand((BLOCK, *moved.shape[1:]), generator=gen).to(x.device) >= p
        rows = (blocks == block).nonzero().squeeze(1)
        keep[rows] = draw[positions[rows] - block * BLOCK]
    return (moved * keep / (1.0 - p)).movedim(0, dim)
