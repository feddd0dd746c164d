"""Data loading for the engine: each data-parallel rank reads its own slice of every global batch."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def build_dataloader(dataset: Dataset, micro_batch_size: int, dp_rank: int, dp_size: int,
                     collate_fn: Callable[..., Any] | None = None, drop_last: bool = False,
                     shuffle: bool = True, seed: int = 0, pin_memory: bool = False,
                     num_workers: int = 0) -> DataLoader:
    """A DataLoader over a DistributedSampler: rank r gets samples r, r+N, ... of each shuffled epoch."""
    if micro_batch_size <= 0:
        raise ValueError(f"micro batch size ({micro_batch_size}) must be > 0")
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                      drop_last=drop_last, pin_memory=pin_memory, num_workers=num_workers)


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
