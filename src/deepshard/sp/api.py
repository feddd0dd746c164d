"""``SequenceParallel``: what a model and a training loop need from sequence parallelism, in one object.

    from deepshard.sp import SequenceParallel
    sp = SequenceParallel.build(topology, mode="ring")       # or SequenceParallel.from_engine(engine)
    batch = sp.shard_batch({"input_ids": ids, "labels": ids})  # this rank's tokens, positions, shifted labels
    out = sp.attention(q, k, v, seq_len)                       # inside the model's attention
    loss = sp.loss(logits, batch["shift_labels"])              # the global token mean, the same on every rank

The loss is what every sp rank backpropagates: the sum over the sp group of each rank's token-loss sum,
over the global count of tokens with a label. ZeRO then averages gradients over dp x sp (``seq_dp``), which
makes the gradient equal to the single-process gradient (DeepSpeed averages over dp only, so its gradient
is sp times larger).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from deepshard.sp.attention import SPGroups, sp_attention
from deepshard.sp.collectives import as_comm, sum_over_group
from deepshard.sp.dropout import positional_dropout
from deepshard.sp.groups import Mode, build_sp_groups
from deepshard.sp.heads import check_tensor_parallel_heads
from deepshard.sp.layout import SeqLayout, pad_sequence
from deepshard.sp.softmax_merge import segment_ids
from deepshard.topology import Topology

IGNORE_INDEX = -100


class SequenceParallel:
    """The sp groups of this rank and the token layout they use (see the module text)."""

    def __init__(self, groups: SPGroups, balance: bool = True, mode: str = "ulysses",
                 tensor_parallel: int = 1, topology: Optional[Topology] = None) -> None:
        self.groups = groups
        self.balance = balance
        self.mode = mode
        self.tensor_parallel = tensor_parallel
        """The grid's tensor-parallel size: above 1 the attention gets one tensor-parallel rank's heads."""
        self.topology = topology
        """The grid the groups were cut from (kept alive with them: ``deepshard.utils.groups`` holds it weakly)."""

    @classmethod
    def build(cls, topology: Topology, mode: Mode = "ulysses", ulysses_size: Optional[int] = None,
              balance: bool = True) -> "SequenceParallel":
        """Collective: every rank calls it with the same arguments."""
        return cls(build_sp_groups(topology, mode, ulysses_size), balance=balance, mode=mode,
                   tensor_parallel=topology.dims.tp, topology=topology)

    @classmethod
    def from_config(cls, topology: Topology, section: Any) -> "SequenceParallel":
        """From the config's ``sequence_parallel`` section (``config.sequence.SequenceParallelConfig``)."""
        return cls.build(topology, section.mode, section.ulysses_size, section.load_balance)

    @classmethod
    def from_engine(cls, engine: Any) -> "SequenceParallel":
        """The engine's (``initialize`` builds it when ``sequence_parallel_size`` > 1)."""
        found = getattr(engine, "sequence_parallel", None)
        if found is None:
            raise ValueError("this engine has no sequence parallelism: set \"sequence_parallel_size\" > 1 in the "
                             "config")
        return found

    # ---------------------------------------------------------------------------------------- facts
    @property
    def size(self) -> int:
        return self.groups.sp.size

    @property
    def rank(self) -> int:
        return self.groups.sp_rank

    @property
    def group(self) -> Any:
        """The torch process group of the sp ranks (None when it is the whole world)."""
        return self.groups.sp.group

    def layout(self, seq_len: int) -> SeqLayout:
        return self.groups.layout(seq_len, self.balance)

    # ------------------------------------------------------------------------------------------ data
    def shard(self, tensor: torch.Tensor, dim: int = 1, pad_value: float = 0) -> torch.Tensor:
        """This rank's tokens of a whole-sequence ``tensor`` (padded at the end to the layout's length)."""
        return self.layout(tensor.shape[dim]).shard(tensor, self.rank, dim, pad_value)

    def positions(self, seq_len: int, batch: int = 1) -> torch.Tensor:
        """This rank's global position ids, [batch, local_len]."""
        return self.layout(seq_len).positions(self.rank).unsqueeze(0).expand(batch, -1)

    def shard_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """A whole-sequence batch (``input_ids`` [b, s], optional ``labels``, ``attention_mask``,
        ``position_ids``) as this rank's piece: ``input_ids``, ``position_ids`` (the batch's, else the global
        positions), ``shift_labels`` (the next token's label, -100 on padding and the last token),
        ``seq_len`` (the unpadded length) and ``segments`` (None, or when ``position_ids`` restart (packed
        documents) or ``attention_mask`` has zeros, the segment of every position for ``attention``)."""
        ids = batch["input_ids"]
        seq_len = ids.shape[1]
        out: dict[str, Any] = {k: v for k, v in batch.items() if not torch.is_tensor(v)}
        out["input_ids"] = self.shard(ids)
        given = batch.get("position_ids")
        if given is not None:
            out["position_ids"] = self.shard(given.expand(ids.shape[0], -1))
        else:
            out["position_ids"] = self.positions(seq_len, ids.shape[0]).to(ids.device)
        segments = segment_ids(given, batch.get("attention_mask"))
        out["segments"] = None if segments is None else pad_sequence(
            segments.expand(ids.shape[0], -1), self.layout(seq_len).padded_len, dim=1, value=-1)
        labels = batch.get("labels")
        if labels is not None:
            shifted = pad_sequence(labels[:, 1:], seq_len, dim=1, value=IGNORE_INDEX)
            mask = batch.get("attention_mask")
            if mask is not None:
                shifted = shifted.masked_fill(pad_sequence(mask[:, 1:], seq_len, 1, 0) == 0, IGNORE_INDEX)
            out["shift_labels"] = self.shard(shifted, pad_value=IGNORE_INDEX)
        out["seq_len"] = seq_len
        return out

    # ------------------------------------------------------------------------------------- compute
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, causal: bool = True,
                  scale: Optional[float] = None, segments: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention of this rank's tokens ([b, h, local, d]; ``k``/``v`` may have fewer heads) over the
        whole sequence of ``seq_len`` tokens; ``segments`` (``shard_batch``'s): packed documents attend
        only within themselves, masked-out tokens are never attended to. Under tensor parallelism these are
        this tensor-parallel rank's heads; heads that do not group are refused with the tp and the fix."""
        if self.tensor_parallel > 1:
            check_tensor_parallel_heads(q.shape[1], k.shape[1], v.shape[1], self.size, self.tensor_parallel)
        return sp_attention(q, k, v, self.groups, self.layout(seq_len), causal=causal, scale=scale, segments=segments)

    def dropout(self, x: torch.Tensor, p: float, seq_len: int, training: bool = True, dim: int = 1) -> torch.Tensor:
        """Dropout on this rank's tokens (along ``dim``) whose mask depends on each token's global position
        only, not on the layout (``dropout.positional_dropout``): the same masks on any number of ranks and
        in one process (with ``positions = arange``), given the same seed."""
        return positional_dropout(x, p, self.layout(seq_len).positions(self.rank), training, dim)

    def loss(self, logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
        """The token-mean cross entropy of the whole sequence (every rank returns the same value)."""
        return sp_token_mean(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             shift_labels.reshape(-1), ignore_index=IGNORE_INDEX,
                                             reduction="sum"),
                             (shift_labels != IGNORE_INDEX).sum(), self.groups.sp)


def sp_token_mean(local_sum: torch.Tensor, local_count: torch.Tensor, comm: Any) -> torch.Tensor:
    """``sum over ranks of local_sum / sum over ranks of local_count`` (at least 1), differentiable in
    ``local_sum`` (``collectives.sum_over_group``). ``comm``: a ``CommGroup`` or a torch process group."""
    comm = as_comm(comm)
    count = local_count.detach().to(torch.float64).reshape(1).clone()
    comm.all_reduce(count)
    return sum_over_group(local_sum, comm) / max(float(count.item()), 1.0)
