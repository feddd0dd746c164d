"""Sequence parallelism: one sample's tokens split over ranks, with attention by Ulysses (all-to-all over
heads), ring attention (key/value blocks around the ranks) or both at once; DeepSpeed's API on top
(``deepshard.sp.hf`` for Hugging Face models, ``deepshard.sequence.layer.DistributedAttention``).
See docs/sequence-parallel.md."""
from deepshard.sp.api import SequenceParallel, sp_token_mean
from deepshard.sp.attention import SPGroups, sp_attention
from deepshard.sp.dropout import positional_dropout
from deepshard.sp.layout import SeqLayout
from deepshard.sp.ring import ring_attention

__all__ = ["SequenceParallel", "SPGroups", "SeqLayout", "positional_dropout", "ring_attention", "sp_attention", "sp_token_mean"]
