"""Who holds which tokens: pure arithmetic, no process group.

The sequence-parallel ranks of one sample form a grid ``ring x ulysses`` (``sp = ring * ulysses``; sp rank
``s = ring_index * ulysses + ulysses_index``, so Ulysses peers are neighbours). The padded sequence is cut
into ``ring`` shards: contiguous, or, with ``balance`` (causal load balancing), shard ``j`` is the chunk
pair ``j`` and ``2*ring - 1 - j`` of ``2*ring`` equal chunks, so every shard sees the same amount of the
causal triangle. Each shard is then cut into ``ulysses`` equal contiguous slices, one per rank; the
all-to-all over the Ulysses group gives every rank of it the whole shard (for 1/ulysses of the heads).

Ulysses alone is ``ring = 1`` (contiguous slices: DeepSpeed's layout); ring alone is ``ulysses = 1``.
A sequence whose length is not a multiple of the grid is padded at the end; the padded positions are
never attended to (``key_is_valid``) and carry no loss.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqLayout:
    """The token layout of one sequence of ``seq_len`` tokens over ``ring * ulysses`` ranks."""

    seq_len: int
    ring: int = 1
    ulysses: int = 1
    balance: bool = True

    def __post_init__(self) -> None:
        for name in ("seq_len", "ring", "ulysses"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SeqLayout.{name} must be a positive integer, got {value!r}")

    @property
    def sp(self) -> int:
        return self.ring * self.ulysses

    @property
    def balanced(self) -> bool:
        """Head-tail chunk pairs are used (only meaningful with a ring of 2 or more)."""
        return self.balance and self.ring > 1

    @property
    def multiple(self) -> int:
        """The padded length is a multiple of this."""
        return self.sp * (2 if self.balanced else 1)

    @property
    def padded_len(self) -> int:
        return math.ceil(self.seq_len / self.multiple) * self.multiple

    @property
    def local_len(self) -> int:
        """Tokens each rank holds (padding included)."""
        return self.padded_len // self.sp

    def shard_positions(self, ring_index: int) -> torch.Tensor:
        """Global positions (padded) of ring shard ``ring_index``, in the order the shard holds them."""
        if not 0 <= ring_index < self.ring:
            raise ValueError(f"ring index {ring_index} is outside 0..{self.ring - 1}")
        if not self.balanced:
            size = self.padded_len // self.ring
            return torch.arange(ring_index * size, (ring_index + 1) * size)
        chunk = self.padded_len // (2 * self.ring)
        head = torch.arange(ring_index * chunk, (ring_index + 1) * chunk)
        tail_index = 2 * self.ring - 1 - ring_index
        tail = torch.arange(tail_index * chunk, (tail_index + 1) * chunk)
        return torch.cat([head, tail])

    def positions(self, sp_rank: int) -> torch.Tensor:
        """Global positions (padded) that sequence-parallel rank ``sp_rank`` holds, in its order."""
        if not 0 <= sp_rank < self.sp:
            raise ValueError(f"sp rank {sp_rank} is outside 0..{self.sp - 1}")
        ring_index, ulysses_index = divmod(sp_rank, self.ulysses)
        shard = self.shard_positions(ring_index)
        return shard.reshape(self.ulysses, -1)[ulysses_index]

    def key_is_valid(self, positions: torch.Tensor) -> torch.Tensor:
        """True where a position is a real token (not padding)."""
        return positions < self.seq_len

    def shard(self, tensor: torch.Tensor, sp_rank: int, dim: int = 1, pad_value: float = 0) -> torch.Tensor:
        """``sp_rank``'s tokens of a whole-sequence ``tensor`` (length ``seq_len`` along ``dim``), padded."""
        if tensor.shape[dim] != self.seq_len:
            raise ValueError(f"the tensor has {tensor.shape[dim]} tokens along dim {dim}, the layout {self.seq_len}")
        padded = pad_sequence(tensor, self.padded_len, dim, pad_value)
        return padded.index_select(dim, self.positions(sp_rank).to(tensor.device))

    def unshard(self, pieces: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The whole sequence (padding removed) from every rank's piece, in sp-rank order."""
        if len(pieces) != self.sp:
            raise ValueError(f"expected {self.sp} pieces, got {len(pieces)}")
        order = torch.cat([self.positions(r) for r in range(self.sp)])
        joined = torch.cat(pieces, dim=dim)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        return joined.index_select(dim, inverse.to(joined.device)).narrow(dim, 0, self.seq_len)


def pad_sequence(tensor: torch.Tensor, length: int, dim: int = 1, value: float = 0) -> torch.Tensor:
    """``tensor`` padded at the end of ``dim`` to ``length`` with ``value``."""
    missing = length - tensor.shape[dim]
    if missing < 0:
        raise ValueError(f"cannot pad {tensor.shape[dim]} tokens down to {length}")
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_full(shape, value)], dim=dim)


def ring_source(ring_index: int, step: int, ring: int) -> int:
    """The ring index whose key/value block ring rank ``ring_index`` holds after ``step`` passes."""
    return (ring_index - step) % ring


def causal_work(layout: SeqLayout) -> list[int]:
    """Query-key pairs each ring shard computes under a causal mask (the load-balance figure)."""
    work = []
    for j in range(layout.ring):
        q = layout.shard_positions(j)
        work.append(int(sum(int((q[:, None] >= layout.shard_positions(i)[None, :]).sum()) for i in range(layout.ring))))
    return work
