"""DeepSpeed's Arctic Long Sequence Training (ALST) names for Hugging Face models
(``deepspeed.runtime.sequence_parallel.ulysses_sp``), on deepshard's Ulysses.

- ``UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation, sequence_parallel_size,
  micro_batch_size, seq_length=None, seq_length_is_variable=True, ...)`` builds the grid (sp groups of
  consecutive ranks, as DeepSpeed), puts a Ulysses wrapper in place of the model's attention function in
  ``transformers``' registry, and returns an mpu for ``deepshard.initialize(mpu=...)``.
- ``UlyssesSPDataLoaderAdapter(dl, sp_rank, sp_group, sp_world_size, device)``: each sp rank reads one
  batch; the ranks process them one after the other, each holding its slice of the sequence.

Where deepshard differs, on purpose: ``eager`` attention is accepted (the wrapper computes the causal
attention itself, exactly, instead of the masked eager kernel DeepSpeed refuses); head counts that do not
divide by the sp size work (``heads.head_plan``); a batch whose length does not divide is padded at the
end (the padding is never attended to by real tokens and carries label -100) instead of refused; and the
gradient equals the single-process gradient (ZeRO averages over dp x sp).
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from deepshard.comm.group import CommGroup
from deepshard.sp.collectives import all_to_all, as_comm
from deepshard.sp.heads import head_plan
from deepshard.sp.layout import SeqLayout, pad_sequence
from deepshard.sp.ring import ring_attention
from deepshard.sp.softmax_merge import segment_ids
from deepshard.sp.tiled import TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute  # noqa: F401  (names)

IGNORE_INDEX = -100


def _exact_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: Optional[float],
                  segments: Optional[torch.Tensor]) -> torch.Tensor:
    """Causal attention over the gathered sequence ([b, h, S, d] -> [b, S, h, d]), GQA included; packed
    documents (``segments``) attend only within themselves."""
    positions = torch.arange(q.shape[2], device=q.device)
    out = ring_attention(q, k, v, CommGroup.single(name="sp_ring"), [positions], causal=True,
                         seq_len=q.shape[2], scale=scaling, segments=segments)
    return out.transpose(1, 2)


def _no_dropout(kwargs: dict[str, Any], module: torch.nn.Module) -> None:
    rate = float(kwargs.get("dropout", 0.0) or 0.0)
    if rate > 0 and module.training:
        raise ValueError(f"attention dropout {rate} with ring/hybrid sequence parallelism, eager attention or packed "
                         "samples: deepshard computes that attention itself, without dropout; set the model's "
                         "attention_dropout to 0 (Llama-style models default to 0)")


class UlyssesSPAttentionHF(torch.nn.Module):
    """Ulysses around a Hugging Face attention function (DeepSpeed's constructor and call signatures).

    ``forward(module, query, key, value, attention_mask, *args, **kwargs)`` takes this rank's slice of the
    sequence in HF's layout [batch, heads, tokens, head_dim] and returns ``(output [batch, tokens,
    heads * head_dim], None)``. ``position_ids`` must be in ``kwargs`` (this rank's global positions)."""

    def __init__(self, attn: Optional[Callable[..., Any]], batch_size: int, attn_head_count: int, attn_head_size: int,
                 kv_head_count: int, num_hidden_layers: int, process_group: Any, seq_length_is_variable: bool = False,
                 local_seq_length: Optional[int] = None, global_seq_length: Optional[int] = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group.group if isinstance(process_group, CommGroup) else process_group
        self.comm = as_comm(process_group)
        self.world_size = self.comm.size
        self.sp_rank = self.comm.rank
        self.batch_size = batch_size
        self.attn_head_count = attn_head_count
        self.attn_head_size = attn_head_size
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length = local_seq_length
        self.global_seq_length = global_seq_length
        self.disable_in_eval = disable_in_eval
        self.core_attn_implementation: Optional[str] = None
        self.sequence_parallel: Any = None  # a deepshard SequenceParallel: ring/hybrid modes run through it
        self.plan = head_plan(attn_head_count, kv_head_count, self.world_size)

    def _check_shapes(self, query: torch.Tensor, key: torch.Tensor) -> None:
        b, h, s, d = query.shape
        expected_s = s if self.seq_length_is_variable or self.local_seq_length is None else self.local_seq_length
        if (b, h, s, d) != (self.batch_size, self.attn_head_count, expected_s, self.attn_head_size) or \
                key.shape[1] != self.global_kv_head_count:
            raise ValueError(f"UlyssesSPAttentionHF: query {tuple(query.shape)} / key {tuple(key.shape)} do not match "
                             f"batch {self.batch_size}, {self.attn_head_count} heads ({self.global_kv_head_count} "
                             f"key/value), {expected_s} local tokens, head size {self.attn_head_size}")

    def forward(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)  # type: ignore[misc]
        if "position_ids" not in kwargs:
            raise ValueError("Ulysses sequence parallelism needs position_ids in every forward() call (this rank's "
                             "global positions; UlyssesSPDataLoaderAdapter puts them in the batch)")
        self._check_shapes(query, key)
        sp = self.sequence_parallel
        if sp is not None and sp.mode != "ulysses":
            return self._through_layout(module, query, key, value, kwargs)
        kwargs["position_ids"] = self._gather_positions(kwargs["position_ids"])
        segments = segment_ids(kwargs["position_ids"])
        heads = query.shape[1]
        q, k, v = self.plan.apply(query, key, value)
        q, k, v = (all_to_all(t.contiguous(), self.comm, scatter_dim=1, gather_dim=2) for t in (q, k, v))
        if self.attn is None or segments is not None:  # eager, or packed samples: computed here, exactly
            _no_dropout(kwargs, module)
            out = _exact_causal(q, k, v, kwargs.get("scaling"), segments)
        else:
            groups = getattr(module, "num_key_value_groups", None)
            if groups is not None:
                module.num_key_value_groups = q.shape[1] // k.shape[1]
            try:
                out, _ = self.attn(module, q, k, v, None, *args, **kwargs)  # [b, S, h_local, d]
            finally:
                if groups is not None:
                    module.num_key_value_groups = groups
        out = all_to_all(out.transpose(1, 2).contiguous(), self.comm, scatter_dim=2, gather_dim=1)[:, :heads]
        b, _, s, d = out.shape
        return out.transpose(1, 2).reshape(b, s, heads * d), None

    def _through_layout(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        kwargs: dict[str, Any]) -> tuple[torch.Tensor, None]:
        """Ring or hybrid: this rank holds the layout's tokens (``UlyssesSPDataLoaderAdapter`` cut them so);
        packed documents are read from the gathered position ids."""
        _no_dropout(kwargs, module)
        sp = self.sequence_parallel
        b, h, s, d = query.shape
        layout = sp.layout(s * self.world_size)
        pieces = [torch.empty_like(kwargs["position_ids"]) for _ in range(self.world_size)]
        dist.all_gather(pieces, kwargs["position_ids"].contiguous(), group=self.process_group)
        segments = segment_ids(layout.unshard(pieces))
        out = sp.attention(query, key, value, layout.seq_len, scale=kwargs.get("scaling"), segments=segments)
        return out.transpose(1, 2).reshape(b, s, h * d), None

    def _gather_positions(self, positions: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return positions
        pieces = [torch.empty_like(positions) for _ in range(self.world_size)]
        dist.all_gather(pieces, positions.contiguous(), group=self.process_group)
        return torch.cat(pieces, dim=1)

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: Optional[int] = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: Optional[int] = None, *, sequence_parallel_mode: str = "ulysses",
                                   ulysses_size: Optional[int] = None, load_balance: bool = True) -> Any:
        """Put Ulysses in place of ``core_attn_implementation`` in transformers' attention registry and return
        the mpu to pass to ``initialize(mpu=...)`` (None when ``sequence_parallel_size`` is 1).

        deepshard's keywords beyond DeepSpeed's: ``sequence_parallel_mode`` "ring" (key/value blocks around
        the sp ranks; any head count) or "hybrid" (Ulysses over ``ulysses_size`` ranks, a ring over the
        rest); ``load_balance`` (ring: head-tail chunks). Ring and hybrid compute the attention themselves
        (``core_attn_implementation`` is then not called)."""
        from deepshard.sp.hf_register import register

        return register(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size, micro_batch_size,
                        seq_length if seq_length is not None else max_length, seq_length_is_variable, disable_in_eval,
                        sequence_parallel_mode, ulysses_size, load_balance)


class UlyssesSPDataLoaderAdapter:
    """Wraps a DataLoader for Ulysses (DeepSpeed's signature): every sp rank reads a batch, the sp ranks
    exchange them, and each ``next()`` gives this rank its contiguous slice of one of them, in sp-rank order:
    ``input_ids``, ``position_ids`` and ``shift_labels`` (``labels`` shifted left, -100 at the end and on
    padding; ``labels`` itself removed), other tensors sliced the same way, non-tensors as they are."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.iter = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> "UlyssesSPDataLoaderAdapter":
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts from a fresh iterator
            raise
        if "position_ids" not in batch:
            raise ValueError("Ulysses sequence parallelism needs position_ids in every batch (torch.arange(seq_len) "
                             "per sample; restarting at document boundaries for packed samples): add them in the "
                             "collate function")
        gathered = self._gather(batch)
        for one in gathered:
            self.micro_batches.append(self._slice(one))

    def _gather(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """Every sp rank's batch, in rank order (sequence lengths may differ between ranks)."""
        n = self.sp_world_size
        objects: list[Any] = [None] * n
        local = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in batch.items()}
        dist.all_gather_object(objects, local, group=self.sp_group)
        return objects

    def _layout(self, seq_len: int) -> SeqLayout:
        """Who holds which tokens: the registered ring/hybrid layout, else Ulysses' contiguous slices."""
        from deepshard.utils.groups import registered_sequence_parallel

        sp = registered_sequence_parallel()
        if sp is not None and sp.size == self.sp_world_size and sp.group is self.sp_group:
            return sp.layout(seq_len)
        return SeqLayout(seq_len, ulysses=self.sp_world_size)

    def _slice(self, batch: dict[str, Any]) -> dict[str, Any]:
        seq_len = batch["input_ids"].shape[1]
        layout = self._layout(seq_len)
        padded = layout.padded_len
        mine = layout.positions(self.sp_rank)
        out: dict[str, Any] = {}
        labels = batch.pop("labels", None)
        mask = batch.pop("attention_mask", None)
        if mask is not None and labels is not None:
            _check_trailing_padding(mask)
            labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
        for key, value in batch.items():
            if not torch.is_tensor(value):
                out[key] = value
                continue
            if value.shape[1] != seq_len:
                raise ValueError(f"{key} has shape {tuple(value.shape)}; it must match input_ids' "
                                 f"{tuple(batch['input_ids'].shape)} along the sequence")
            if key == "position_ids":
                tail = value[:, -1:] + torch.arange(1, padded - seq_len + 1)
                value = torch.cat([value, tail], dim=1)
            else:
                value = pad_sequence(value, padded, dim=1, value=0)
            out[key] = value.index_select(1, mine.to(value.device))
        if labels is not None:
            shifted = pad_sequence(labels[:, 1:], padded, dim=1, value=IGNORE_INDEX)
            out["shift_labels"] = shifted.index_select(1, mine.to(shifted.device)).contiguous()
        return out


def _check_trailing_padding(mask: torch.Tensor) -> None:
    """The ALST path reads documents from position_ids, not attention_mask (nor does DeepSpeed's): only
    padding at the end of a sample, which causal attention never reads, is exact."""
    ones_after_zero = (mask.cumsum(1) < torch.arange(1, mask.shape[1] + 1, device=mask.device)) & (mask != 0)
    if bool(ones_after_zero.any()):
        raise ValueError("UlyssesSPDataLoaderAdapter: attention_mask has zeros before real tokens (left or inner "
                         "padding); sequence parallelism reads documents from position_ids and does not apply "
                         "attention_mask: pack the samples instead (position_ids restarting at each document) or "
                         "pad at the end only. deepshard.sp.SequenceParallel.shard_batch applies any mask")
