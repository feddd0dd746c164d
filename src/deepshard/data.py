"""Data loading for the engine: each data-parallel rank reads its own slice of every global batch."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler


def build_dataloader(dataset: Dataset, micro_batch_size: int, dp_rank: int, dp_size: int,
                     collate_fn: Callable[..., Any] | None = None, drop_last: bool = False,
                     shuffle: bool = True, seed: int = 0, pin_memory: bool = False,
                     num_workers: int = 0, accumulation: int | None = None,
                     contiguous: bool = False) -> DataLoader:
    """A DataLoader over a DistributedSampler: rank r gets samples r, r+N, ... of each shuffled epoch.
    ``accumulation`` given (the deterministic mode): over an ``AtomSampler`` instead, in the contiguous
    split or not (``contiguous``)."""
    if micro_batch_size <= 0:
        raise ValueError(f"micro batch size ({micro_batch_size}) must be > 0")
    sampler: Sampler[int]
    if accumulation is not None:
        sampler = AtomSampler(dataset, micro_batch_size, dp_rank, dp_size, accumulation, seed, shuffle, drop_last,
                              contiguous)
    else:
        sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle,
                                     seed=seed, drop_last=drop_last)
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                      drop_last=drop_last, pin_memory=pin_memory, num_workers=num_workers)


class AtomSampler(Sampler[int]):
    """The deterministic mode's order (docs/determinism.md): each global batch (``micro x dp x gas``
    consecutive samples of the epoch's shuffled order, the same shuffle as ``DistributedSampler``'s) is cut
    into ``dp x gas`` micro-batches, and rank ``r``'s micro-step ``m`` gets micro-batch ``m x dp + r``
    (``contiguous``: ``r x gas + m``, the split ZeRO stages 0 and 1 take where they can,
    ``deepshard.zero.canonical``). Every split of the same global batch over ranks and accumulation steps
    then trains the same micro-batches.
    An epoch that is not a whole number of global batches is completed from its start (or, with
    ``drop_last``, cut to whole global batches)."""

    def __init__(self, dataset: Dataset, micro: int, rank: int, world: int, accumulation: int, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False, contiguous: bool = False) -> None:
        self.count = len(dataset)  # type: ignore[arg-type]
        self.contiguous = contiguous
        self.micro, self.rank, self.world, self.accumulation = micro, rank, world, accumulation
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0
        batch = micro * world * accumulation
        self.total = (self.count // batch if drop_last else -(-self.count // batch)) * batch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.count, generator=g)
        else:
            order = torch.arange(self.count)
        if self.total > self.count:
            order = order.repeat(-(-self.total // self.count))
        if self.contiguous:
            mine = order[:self.total].view(-1, self.world, self.accumulation, self.micro)[:, self.rank]
        else:
            mine = order[:self.total].view(-1, self.accumulation, self.world, self.micro)[:, :, self.rank]
        return iter(mine.reshape(-1).tolist())

    def __len__(self) -> int:
        return self.total // self.world

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class RepeatingLoader:
    """Wraps an iterable so it never raises StopIteration: it restarts (and bumps the sampler's epoch)."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.epoch = 0
        self._it: Iterator[Any] = iter(loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            self.epoch += 1
            sampler = getattr(self.loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            self._it = iter(self.loader)
            return next(self._it)
