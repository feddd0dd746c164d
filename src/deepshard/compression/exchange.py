"""Averaging a list of tensors over a data-parallel group: exactly (one fp32 all-reduce) or 1-bit
compressed with error feedback on both sides (the 1-bit Adam exchange, arXiv 2102.02888 section 4).

The compressed exchange is an all-reduce built from two compressed collectives, as the paper's
"compressed allreduce" is:

1. worker: ``x = tensors + worker_error``; compress each (row, tensor) cell to signs + one scale; keep
   the new ``worker_error``; ``all_to_all`` sends row ``r`` to rank ``r``;
2. server (every rank, for its row): average the ``N`` decompressed rows, add ``server_error``,
   compress again, keep the new ``server_error``; ``all_gather`` the compressed rows;
3. every rank decompresses the ``N`` rows: the same averaged tensors everywhere.

Each process sends ``(N-1)/N`` of ``C/8 + 4*segments`` bytes in each of the two collectives, where
an fp32 ring all-reduce sends ``2 (N-1)/N`` of ``4*numel`` bytes: 1/32 of the volume, plus the scales
and the padding to multiples of ``8N`` elements.
"""
from __future__ import annotations

import torch

from deepshard.comm.group import CommGroup
from deepshard.compression.onebit import Compressed, ExchangeLayout, compress, decompress


class ExactAverage:
    """The uncompressed reference: one fp32 all-reduce of the flattened tensors, divided by ``N``."""

    def __init__(self, comm: CommGroup) -> None:
        self.comm = comm

    def __call__(self, tensors: list[torch.Tensor]) -> None:
        if self.comm.size == 1 or not tensors:
            return
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        self.comm.all_reduce(flat)
        flat.div_(self.comm.size)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def state_bytes(self) -> int:
        return 0

    def reset(self) -> None:
        """Nothing carried between calls."""


class CompressedAverage:
    """Average the same list of tensors (by shape) over ``comm`` at every call, 1-bit compressed, with
    the worker and server errors carried from call to call. Built for one list of shapes."""

    def __init__(self, comm: CommGroup, numels: list[int], device: torch.device) -> None:
        self.comm = comm
        self.layout = ExchangeLayout(list(numels), comm.size)
        self.mask = self.layout.mask.to(device)
        self.counts = self.layout.counts(device)
        self.device = device
        self.worker_error = torch.zeros(comm.size, self.layout.columns, device=device)
        self.server_error = torch.zeros(1, self.layout.columns, device=device)

    def reset(self) -> None:
        """Forget the carried errors (after a checkpoint load: they are not saved, as in DeepSpeed)."""
        self.worker_error.zero_()
        self.server_error.zero_()

    def state_bytes(self) -> int:
        return (self.worker_error.numel() + self.server_error.numel()) * 4

    def __call__(self, tensors: list[torch.Tensor]) -> None:
        if [t.numel() for t in tensors] != self.layout.numels:
            raise ValueError(f"CompressedAverage was built for tensors of {self.layout.numels} elements, "
                             f"called with {[t.numel() for t in tensors]}")
        columns = self.layout.columns
        x = self.layout.to_matrix(tensors) + self.worker_error
        sent, self.worker_error = compress(x, self.layout, self.mask, self.counts)
        wire = sent.to_bytes()
        received = torch.empty_like(wire)
        self.comm.all_to_all_single(received, wire)
        rank = self.comm.rank
        row_mask, row_counts = self.mask[rank:rank + 1], self.counts[rank:rank + 1]
        workers = decompress(Compressed.from_bytes(received, columns), self.layout)
        mean = workers.mean(dim=0, keepdim=True) * row_mask + self.server_error
        server, self.server_error = compress(mean, self.layout, row_mask, row_counts)
        mine = server.to_bytes()
        gathered = torch.empty(self.comm.size, mine.shape[1], dtype=torch.uint8, device=self.device)
        self.comm.all_gather_into_tensor(gathered, mine)
        result = decompress(Compressed.from_bytes(gathered, columns), self.layout)
        self.layout.from_matrix(result, tensors)

    def wire_bytes(self) -> int:
        """Bytes of one rank's message in each of the two collectives (signs + scales, all rows)."""
        return self.comm.size * (self.layout.columns // 8 + 4 * self.layout.segments)
