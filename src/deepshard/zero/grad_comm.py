"""How a ZeRO stage turns one bucket's gradients into this rank's reduced chunk, over the groups of
``deepshard.zero.hierarchy``:

1. a reduce-scatter over the *shard* group (the whole data-parallel group, or MiCS's / hybrid sharding's
   group of ``mics_shard_size`` ranks): the pieces as they are (``CommGroup.reduce_scatter_pieces``), or,
   with ZeRO++'s qgZ (``zero_quantized_gradients``), the quantized two-hop all-to-all of
   ``deepshard.comm.hierarchical`` (intra-node, then inter-node, fp32 accumulation);
2. with hybrid sharding, an all-reduce of that chunk across the *replica* group (the ranks holding the
   same chunk in the other shard groups), so every replica ends with the sum over all ranks.

The sum is over ``world = shard x replica`` ranks; the reducers divide by it.

Reduction order: the plain path keeps the shard group's own order; qgZ adds this rank's part exactly and
the others' as decoded integers, so its result depends on the quantization by nature and is not
bitwise equal to the unquantized sum (nor meant to be): the quantization error (half a step of the
block's scale) is far larger than any reordering's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from deepshard.comm.group import CommGroup
from deepshard.comm.transport import padded_concat
from deepshard.comm.hierarchical import Hierarchy, quantized_reduce_scatter
from deepshard.comm.staged import Stages, StagedWork


@dataclass(frozen=True)
class GradReduce:
    """The gradient reduction of one domain (see the module docstring). ``quantize_bits``: qgZ's width
    (None: no quantization); ``hierarchy``: the shard group's intra/inter-node sub-groups (qgZ's hops)."""

    shard: CommGroup
    replica: Optional[CommGroup] = None
    hierarchy: Optional[Hierarchy] = None
    quantize_bits: Optional[int] = None

    def __post_init__(self) -> None:
        if self.quantize_bits is not None and self.hierarchy is None:
            raise ValueError("quantized gradients need the shard group's node hierarchy (deepshard.zero.hierarchy)")

    @property
    def world(self) -> int:
        """The ranks the sum runs over (what the average divides by)."""
        return self.shard.size * (self.replica.size if self.replica is not None else 1)

    @property
    def plain(self) -> bool:
        """True when this is the shard group's own reduce-scatter and nothing more."""
        return self.quantize_bits is None and (self.replica is None or self.replica.size == 1)

    def start_pieces(self, pieces: list[torch.Tensor], chunk: int, key: int = 0) -> Any:
        """Start reducing the concatenation of the 1-D ``pieces`` (zero-padded to ``shard.size * chunk``);
        the handle's ``result`` is this rank's reduced chunk after ``wait()``."""
        if self.quantize_bits is None:
            first = self.shard.reduce_scatter_pieces(pieces, chunk, key=key)
        else:
            assert self.hierarchy is not None  # __post_init__
            full = padded_concat(pieces, chunk * self.shard.size)
            first = quantized_reduce_scatter(full, chunk, self.hierarchy, self.quantize_bits)
        return self._across_replicas(first, None)

    def start_tensor(self, out: torch.Tensor, full: torch.Tensor) -> Any:
        """Start reducing ``full`` into ``out`` (this rank's chunk; it may be a slice of ``full`` on pairwise
        backends, as ``CommGroup.reduce_scatter_tensor`` allows). ``wait()`` leaves the sum in ``out``."""
        if self.quantize_bits is not None:
            assert self.hierarchy is not None
            first: Any = quantized_reduce_scatter(full, out.numel(), self.hierarchy, self.quantize_bits)
        else:
            first = self.shard.reduce_scatter_tensor(out, full, async_op=True)
        return self._across_replicas(first, out)

    def _across_replicas(self, first: Any, out: Optional[torch.Tensor]) -> Any:
        if self.plain:
            return first
        return StagedWork(self._stages(first, out), scratch_bytes=int(getattr(first, "scratch_bytes", 0)))

    def _stages(self, first: Any, out: Optional[torch.Tensor]) -> Stages:
        yield first
        if out is None:
            chunk = first.result
        else:
            if self.quantize_bits is not None:  # qgZ returns its chunk; the plain collective wrote ``out``
                out.copy_(first.result)
            chunk = out
        if self.replica is not None and self.replica.size > 1:
            yield self.replica.all_reduce(chunk, async_op=True)
        return chunk
