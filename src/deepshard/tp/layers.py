"""Megatron-style tensor-parallel layers over one tensor-parallel ``CommGroup``.

- ``ColumnParallelLinear``: the weight split along the output features; each rank computes its slice of
  the output (optionally all-gathered). Backward all-reduces the input's gradient (``f``).
- ``RowParallelLinear``: the weight split along the input features; the partial outputs are summed
  (``g``) and the bias is added once, after the sum.
- ``VocabParallelEmbedding``: the table split along the vocabulary; ids outside this rank's range give
  zeros, and the sum over the ranks gives every token its row.
- ``SequenceParallel``: wraps a norm (any module whose parameters are replicated) so it runs on a
  sequence shard; its parameters' gradients are summed over the group.
- ``TensorParallelDropout``: dropout drawing from the per-tensor-parallel-rank stream.

With ``sequence_parallel=True`` the activations between the linear layers are split along
``sequence_dim``: the column layer all-gathers them, the row layer reduce-scatters its output.

Built from scratch, each layer first initializes the full, unsplit layer with torch's own
initialization (the same random draws as the plain ``nn.Linear``/``nn.Embedding`` under the same seed),
then keeps its slice: a model written with these layers starts from exactly the parameters of the same
model written with plain layers. ``from_linear``/``from_embedding`` slice an existing layer (automatic TP).
"""
from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from deepshard.comm.group import CommGroup
from deepshard.tp.mappings import (copy_to_tp_region, gather_from_sequence_parallel, gather_from_tp_region,
                                   reduce_from_tp_region, reduce_scatter_to_sequence_parallel,
                                   scatter_to_tp_region)
from deepshard.tp.params import mark_sequence_parallel, mark_tp_split, shard_of
from deepshard.tp.random import RngTracker, TP_STREAM


class SharedInput:
    """Lets column-parallel layers that read the same input tensor (q, k and v; gate and up) share one
    ``f``: they then consume one identity node, autograd sums their input gradients into it, and the
    all-reduce runs once instead of once per layer (the same sum, a third of the traffic for q/k/v).

    The match is by identity (held weakly) and version of the input tensor; the shared node (a view of
    the input, no copy) is dropped when its gradient has been computed."""

    def __init__(self, group: CommGroup) -> None:
        self.group = group
        self._input: Optional[weakref.ref] = None
        self._version = -1
        self._entered: Optional[torch.Tensor] = None

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """``copy_to_tp_region(x)``, reused while the same ``x`` is read again."""
        if (self._entered is not None and self._input is not None and self._input() is x
                and self._version == x._version):
            return self._entered
        entered = copy_to_tp_region(x, self.group)
        if entered.requires_grad:
            self._input, self._version, self._entered = weakref.ref(x), x._version, entered
            entered.register_hook(self._forget)
        return entered

    def _forget(self, grad: torch.Tensor) -> None:
        """Backward reached the shared node (every reader's gradient is in): nothing to keep."""
        self._input, self._entered = None, None


def _check_divides(what: str, size: int, group: CommGroup) -> int:
    if size % group.size != 0:
        raise ValueError(f"{what} ({size}) must be divisible by the tensor-parallel size ({group.size}); "
                         f"choose a tensor-parallel size that divides {size}")
    return size // group.size


def _parameter(tensor: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    return nn.Parameter(tensor.detach().clone().contiguous(), requires_grad=requires_grad)


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split along its rows (the output features) over ``group``.

    ``gather_output``: return the full output (all-gathered) instead of this rank's slice.
    ``sequence_parallel``: the input is this rank's sequence shard; it is all-gathered first.
    ``parts``: sizes of fused outputs (q, k, v) each split separately, so rank r keeps its slice of
    every part (automatic TP of a fused qkv or gate_up projection)."""

    def __init__(self, in_features: int, out_features: int, group: CommGroup, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, sequence_dim: int = 1,
                 parts: Optional[Sequence[int]] = None, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        full = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup(full.weight, full.bias, group, gather_output, sequence_parallel, sequence_dim, parts)

    @classmethod
    def from_linear(cls, linear: nn.Module, group: CommGroup, gather_output: bool = False,
                    sequence_parallel: bool = False, sequence_dim: int = 1,
                    parts: Optional[Sequence[int]] = None, transposed: bool = False) -> "ColumnParallelLinear":
        """This rank's slice of an existing ``nn.Linear`` (``weight`` ``[out, in]``), or with
        ``transposed`` of a layer storing ``weight`` as ``[in, out]`` (GPT-2's ``Conv1D``), kept so."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(linear.weight, linear.bias, group, gather_output, sequence_parallel, sequence_dim, parts,
                     transposed)
        return layer

    def _setup(self, weight: torch.Tensor, bias: Optional[torch.Tensor], group: CommGroup, gather_output: bool,
               sequence_parallel: bool, sequence_dim: int, parts: Optional[Sequence[int]],
               transposed: bool = False) -> None:
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output=True and sequence_parallel=True do not combine "
                             "(the output would be full-sequence and full-width); gather in the caller instead")
        if parts and gather_output:
            raise ValueError("ColumnParallelLinear: a fused layer (parts=...) cannot gather its output in "
                             "order; split the parts before gathering")
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.transposed = transposed
        self.shared_input: Optional[SharedInput] = None  # set by automatic TP on sibling layers
        out_dim = 1 if transposed else 0
        self.out_features, self.in_features = weight.shape[out_dim], weight.shape[1 - out_dim]
        if not parts:
            _check_divides("ColumnParallelLinear out_features", self.out_features, group)
        self.weight = _parameter(shard_of(weight, out_dim, group.rank, group.size, parts), weight.requires_grad)
        mark_tp_split(self.weight, out_dim, group.rank, group.size, parts)
        self.bias: Optional[nn.Parameter] = None
        if bias is not None:
            self.bias = _parameter(shard_of(bias, 0, group.rank, group.size, parts), bias.requires_grad)
            mark_tp_split(self.bias, 0, group.rank, group.size, parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel(x, self.group, self.sequence_dim)
        elif self.shared_input is not None:
            x = self.shared_input.enter(x)
        else:
            x = copy_to_tp_region(x, self.group)
        y = F.linear(x, self.weight.t() if self.transposed else self.weight, self.bias)
        return gather_from_tp_region(y, self.group, -1) if self.gather_output else y

    def extra_repr(self) -> str:
        local = self.weight.shape[1 if self.transposed else 0]
        return (f"in_features={self.in_features}, out_features={self.out_features} (local {local}), "
                f"tp={self.group.size}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split along its columns (the input features) over ``group``.

    ``input_is_parallel``: the input already is this rank's slice of the features (the output of a
    ``ColumnParallelLinear``); otherwise the layer keeps its slice of a full input.
    ``sequence_parallel``: the output is reduce-scattered along ``sequence_dim`` instead of all-reduced.
    The bias is added after the reduction, once."""

    def __init__(self, in_features: int, out_features: int, group: CommGroup, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, sequence_dim: int = 1,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        full = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup(full.weight, full.bias, group, input_is_parallel, sequence_parallel, sequence_dim, False)

    @classmethod
    def from_linear(cls, linear: nn.Module, group: CommGroup, input_is_parallel: bool = True,
                    sequence_parallel: bool = False, sequence_dim: int = 1,
                    transposed: bool = False) -> "RowParallelLinear":
        """This rank's slice of an existing ``nn.Linear`` (``transposed``: ``weight`` is ``[in, out]``)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(linear.weight, linear.bias, group, input_is_parallel, sequence_parallel, sequence_dim,
                     transposed)
        return layer

    def _setup(self, weight: torch.Tensor, bias: Optional[torch.Tensor], group: CommGroup,
               input_is_parallel: bool, sequence_parallel: bool, sequence_dim: int,
               transposed: bool = False) -> None:
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.transposed = transposed
        in_dim = 0 if transposed else 1
        self.in_features, self.out_features = weight.shape[in_dim], weight.shape[1 - in_dim]
        _check_divides("RowParallelLinear in_features", self.in_features, group)
        self.weight = _parameter(shard_of(weight, in_dim, group.rank, group.size), weight.requires_grad)
        mark_tp_split(self.weight, in_dim, group.rank, group.size)
        self.bias: Optional[nn.Parameter] = None
        if bias is not None:
            self.bias = _parameter(bias, bias.requires_grad)
            if sequence_parallel:
                mark_sequence_parallel(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group, -1)
        y = F.linear(x, self.weight.t() if self.transposed else self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel(y, self.group, self.sequence_dim)
        else:
            y = reduce_from_tp_region(y, self.group)
        if self.bias is None:
            return y
        # under sequence parallelism each rank adds the bias to a different shard: sum its gradient
        bias = copy_to_tp_region(self.bias, self.group) if self.sequence_parallel else self.bias
        return y + bias

    def extra_repr(self) -> str:
        local = self.weight.shape[0 if self.transposed else 1]
        return (f"in_features={self.in_features} (local {local}), out_features={self.out_features}, "
                f"tp={self.group.size}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """An embedding table split along the vocabulary: rank r holds rows ``[r*V/t, (r+1)*V/t)``.

    Ids outside the local range look up zeros; the sum over the group (reduce-scatter along
    ``sequence_dim`` with ``sequence_parallel``) gives every token its row."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: CommGroup,
                 padding_idx: Optional[int] = None, sequence_parallel: bool = False, sequence_dim: int = 1,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        full = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx, device=device, dtype=dtype)
        self._setup(full.weight, group, full.padding_idx, sequence_parallel, sequence_dim)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: CommGroup, sequence_parallel: bool = False,
                       sequence_dim: int = 1) -> "VocabParallelEmbedding":
        """This rank's rows of an existing ``nn.Embedding``."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(embedding.weight, group, embedding.padding_idx, sequence_parallel, sequence_dim)
        return layer

    def _setup(self, weight: torch.Tensor, group: CommGroup, padding_idx: Optional[int], sequence_parallel: bool,
               sequence_dim: int) -> None:
        self.group, self.sequence_parallel, self.sequence_dim = group, sequence_parallel, sequence_dim
        self.num_embeddings, self.embedding_dim = weight.shape
        local = _check_divides("VocabParallelEmbedding num_embeddings (the vocabulary)", self.num_embeddings, group)
        self.vocab_start, self.vocab_end = group.rank * local, (group.rank + 1) * local
        self.padding_idx = padding_idx
        self.weight = _parameter(shard_of(weight, 0, group.rank, group.size), weight.requires_grad)
        mark_tp_split(self.weight, 0, group.rank, group.size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        pad = None
        if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end:
            pad = self.padding_idx - self.vocab_start
        rows = F.embedding(local_ids, self.weight, padding_idx=pad)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(rows, self.group, self.sequence_dim)
        return reduce_from_tp_region(rows, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}), "
                f"tp={self.group.size}")


class SequenceParallel(nn.Module):
    """Runs ``module`` (a norm: replicated parameters, position-wise) on this rank's sequence shard.

    Each rank's parameter gradient covers only its tokens, so the parameters enter through
    ``copy_to_tp_region``, which sums their gradients over the group in the backward."""

    def __init__(self, module: nn.Module, group: CommGroup) -> None:
        super().__init__()
        self.module, self.group = module, group
        for p in module.parameters():
            mark_sequence_parallel(p)

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self.module(*args, **kwargs)
        params = {name: copy_to_tp_region(p, self.group) for name, p in self.module.named_parameters()}
        return torch.func.functional_call(self.module, params, args, kwargs)


class TensorParallelDropout(nn.Module):
    """Dropout drawing from ``tracker``'s per-tensor-parallel-rank stream (inside a TP region, or on a
    sequence shard), so ranks holding different activations drop independently."""

    def __init__(self, p: float, tracker: RngTracker, stream: str = TP_STREAM) -> None:
        super().__init__()
        self.p, self.tracker, self.stream = p, tracker, stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.tracker.fork(self.stream):
            return F.dropout(x, self.p, training=True)


def parallel_lm_logits(hidden: torch.Tensor, weight: torch.Tensor, group: CommGroup, sequence_parallel: bool = False,
                       sequence_dim: int = 1, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Vocab-parallel logits ``hidden @ weight^T`` with ``weight`` this rank's vocabulary rows (an output
    head, or a ``VocabParallelEmbedding``'s table when tied). Returns this rank's ``[..., V/t]`` slice,
    for ``vocab_parallel_cross_entropy``; the logits are never gathered."""
    if sequence_parallel:
        hidden = gather_from_sequence_parallel(hidden, group, sequence_dim)
    else:
        hidden = copy_to_tp_region(hidden, group)
    return F.linear(hidden, weight, bias)
