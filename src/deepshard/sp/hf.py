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
from deepshard.sp.layout import pad_sequence
from deepshard.sp.ring import ring_attention
from deepshard.sp.tiled import TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute  # noqa: F401  (names)

IGNORE_INDEX = -100


def _exact_causal(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: Optional[float]
                  ) -> torch.Tensor:
    """Causal attention over the gathered sequence ([b, h, S, d] -> [b, S, h, d]), GQA included."""
    positions = torch.arange(q.shape[2])
    out = ring_attention(q, k, v, CommGroup.single(name="sp_ring"), [positions], causal=True,
                         seq_len=q.shape[2], scale=scaling)
    return out.transpose(1, 2)


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
        kwargs["position_ids"] = self._gather_positions(kwargs["position_ids"])
        heads = query.shape[1]
        q, k, v = self.plan.apply(query, key, value)
        q, k, v = (all_to_all(t.contiguous(), self.comm, scatter_dim=1, gather_dim=2) for t in (q, k, v))
        if self.attn is None:  # eager: computed here, exactly
            out = _exact_causal(module, q, k, v, kwargs.get("scaling"))
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
                                   max_length: Optional[int] = None) -> Any:
        """Put Ulysses in place of ``core_attn_implementation`` in transformers' attention registry and return
        the mpu to pass to ``initialize(mpu=...)`` (None when ``sequence_parallel_size`` is 1)."""
        from deepshard.sp.hf_register import register

        return register(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size, micro_batch_size,
                        seq_length if seq_length is not None else max_length, seq_length_is_variable, disable_in_eval)


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

    def _slice(self, batch: dict[str, Any]) -> dict[str, Any]:
        n = self.sp_world_size
        seq_len = batch["input_ids"].shape[1]
        padded = -(-seq_len // n) * n
        chunk = padded // n
        out: dict[str, Any] = {}
        labels = batch.pop("labels", None)
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
            out[key] = value[:, chunk * self.sp_rank:chunk * (self.sp_rank + 1)]
        if labels is not None:
            shifted = pad_sequence(labels[:, 1:], padded, dim=1, value=IGNORE_INDEX)
            out["shift_labels"] = shifted[:, chunk * self.sp_rank:chunk * (self.sp_rank + 1)].contiguous()
        return out
