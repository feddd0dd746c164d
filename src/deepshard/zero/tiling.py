"""``TiledLinear``: one large linear layer as a grid of smaller ones, so ZeRO-3 holds one tile at a time.

Under ZeRO stage 3 a module's parameters are gathered whole for its forward. A single huge ``nn.Linear``
(a vocabulary projection, a wide MLP) then needs all of its weight gathered on every rank at once. Cutting it
into ``out_splits x in_splits`` tiles, each its own ``nn.Linear`` module, lets the stage-3 hooks gather,
use and release the tiles one after another: the peak is one tile instead of the whole layer. The result
is the same linear map: output tile ``o`` is the sum over input tiles ``i`` of ``tile[o][i](x_i)``, the
bias living on the last input tile of each row, and the output tiles are concatenated.

The tile edges are :func:`deepshard.runtime.partitioning.partition_uniform` of each dimension
(``in_parts`` / ``out_parts``: tile ``k`` covers ``[parts[k], parts[k + 1])``), as DeepSpeed's
``deepspeed.zero.TiledLinear``, whose signature and attributes these classes keep.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from deepshard.runtime.partitioning import partition_uniform
from deepshard.zero.stage3.gather import GatheredParameters

__all__ = ["TiledLinear", "TiledLinearReturnBias"]


class TiledLinear(torch.nn.Module):
    """A ``torch.nn.Linear(in_features, out_features, bias)`` computed by ``out_splits x in_splits`` tiles.

    Args:
        in_splits / out_splits: tiles along the input / output dimension, each in ``[1, features]``.
        input_is_already_split: ``forward`` receives the ``in_splits`` input pieces as a sequence.
        combine_out_splits: concatenate the output tiles (else ``forward`` returns their list).
        linear_cls: the class of each tile (``torch.nn.Linear`` or one with its signature).
        init_linear: a linear layer of the full size whose weight and bias the tiles start from.
        kwargs: passed on to ``linear_cls``.

    Raises:
        RuntimeError: a split count outside ``[1, features]`` (DeepSpeed's error type).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls: type = torch.nn.Linear, init_linear: torch.nn.Module | None = None,
                 **kwargs: Any) -> None:
        super().__init__()
        for name, splits, features in (("in_splits", in_splits, in_features), ("out_splits", out_splits,
                                                                                out_features)):
            if not 1 <= splits <= features:
                raise RuntimeError(f"TiledLinear: {name}={splits} must be in [1, {features}] (one tile at least, "
                                   "no tile thinner than one feature)")
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = partition_uniform(in_features, in_splits)
        self.out_parts = partition_uniform(out_features, out_splits)
        self.linears = torch.nn.ModuleList()
        for o in range(out_splits):
            row = torch.nn.ModuleList()
            for i in range(in_splits):
                row.append(linear_cls(self.in_parts[i + 1] - self.in_parts[i],
                                      self.out_parts[o + 1] - self.out_parts[o],
                                      bias=bias and i == in_splits - 1, **kwargs))
            self.linears.append(row)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: Any) -> Any:
        if self.input_is_already_split:
            pieces = list(input_)
            if len(pieces) != self.in_splits:
                raise ValueError(f"TiledLinear(input_is_already_split=True) expects {self.in_splits} input "
                                 f"pieces, got {len(pieces)}")
        else:
            sizes = [b - a for a, b in zip(self.in_parts[:-1], self.in_parts[1:])]
            pieces = list(torch.split(input_, sizes, dim=-1))
        outputs = []
        for row in self.linears:
            acc = None
            for tile, piece in zip(row, pieces):
                acc = self._reduce_local_output(acc, tile(piece))
            outputs.append(acc)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _reduce_local_output(self, current: Any, new: Any) -> Any:
        """Add one input tile's contribution to its output row."""
        return new if current is None else current + new

    def _combine_output_splits(self, outputs: Sequence[Any]) -> Any:
        return torch.cat(list(outputs), dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: torch.nn.Module) -> None:
        """Set the tiles from a full-size linear layer ``other`` (its ``weight`` is ``[out, in]``). With ZeRO-3
        parameters this is a collective: every rank calls it, rank 0's values are kept."""
        if self.use_bias and getattr(other, "bias", None) is None:
            raise ValueError("TiledLinear.copy_params_from: this layer has a bias and the source has none")
        sources = [other.weight] + ([other.bias] if self.use_bias else [])
        with GatheredParameters(sources):
            if tuple(other.weight.shape) != (self.out_features, self.in_features):
                raise ValueError(f"TiledLinear.copy_params_from: expected a weight of shape "
                                 f"{(self.out_features, self.in_features)}, got {tuple(other.weight.shape)}")
            for o, row in enumerate(self.linears):
                rows = slice(self.out_parts[o], self.out_parts[o + 1])
                for i, tile in enumerate(row):
                    cols = slice(self.in_parts[i], self.in_parts[i + 1])
                    with GatheredParameters(tile.weight, modifier_rank=0):
                        tile.weight.copy_(other.weight[rows, cols])
                    if tile.bias is not None:
                        with GatheredParameters(tile.bias, modifier_rank=0):
                            tile.bias.copy_(other.bias[rows])


class TiledLinearReturnBias(TiledLinear):
    """:class:`TiledLinear` over tiles that return ``(output, bias)`` without adding the bias (Megatron-LM's
    delayed bias, added later in a fused kernel); returns ``(output, bias)`` of the full layer, the bias
    ``None`` when the tiles have none."""

    def _reduce_local_output(self, current: Any, new: Any) -> Any:
        out, bias = new
        if current is None:
            return out, bias
        return current[0] + out, bias if bias is not None else current[1]

    def _combine_output_splits(self, outputs: Sequence[Any]) -> Any:
        tensors = torch.cat([out for out, _ in outputs], dim=-1)
        biases = [bias for _, bias in outputs]
        if all(b is None for b in biases):
            return tensors, None
        if any(b is None for b in biases):
            raise ValueError("TiledLinearReturnBias: some output tiles returned a bias and some did not")
        return tensors, torch.cat(biases, dim=-1)
