"""Tensor parallelism: Megatron's conjugate operators and layers, the vocab-parallel cross-entropy,
sequence parallelism, per-rank dropout streams, and automatic TP for Hugging Face-style models.

Everything takes the tensor-parallel ``CommGroup`` (``engine.topology.tp`` or ``Topology.build(...).tp``)
explicitly; nothing is global.
"""
from deepshard.tp.cross_entropy import vocab_parallel_cross_entropy
from deepshard.tp.grad_norm import clip_tp_grad_norm_, tp_grad_norm_squared
from deepshard.tp.layers import (ColumnParallelLinear, RowParallelLinear, SequenceParallel, TensorParallelDropout,
                                 VocabParallelEmbedding, parallel_lm_logits)
from deepshard.tp.mappings import (copy_to_tp_region, gather_from_sequence_parallel, gather_from_tp_region,
                                   reduce_from_tp_region, reduce_scatter_to_sequence_parallel,
                                   scatter_to_sequence_parallel, scatter_to_tp_region)
from deepshard.tp.params import is_tp_split, mark_tp_split, shard_of, unshard
from deepshard.tp.random import RngTracker, tensor_parallel_rng

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "SequenceParallel",
    "TensorParallelDropout", "parallel_lm_logits", "vocab_parallel_cross_entropy", "copy_to_tp_region",
    "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region", "gather_from_sequence_parallel",
    "reduce_scatter_to_sequence_parallel", "scatter_to_sequence_parallel", "is_tp_split", "mark_tp_split",
    "shard_of", "unshard", "RngTracker", "tensor_parallel_rng", "tp_grad_norm_squared", "clip_tp_grad_norm_",
]
