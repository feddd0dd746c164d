"""The device in one place: cpu or cuda, its collective backend, synchronization and memory figures.

Everything that differs between CPU and CUDA lives here so the engine and strategies are the same code
on both (DESIGN.md principle: no `assert backend == "nccl"`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import psutil
import torch


@dataclass(frozen=True)
class Accelerator:
    """One process's device. ``kind`` is ``"cpu"`` or ``"cuda"``."""

    kind: str
    index: int = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device(self.kind, self.index)

    @property
    def backend(self) -> str:
        return "nccl" if self.kind == "cuda" else "gloo"

    def synchronize(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)

    def set_device(self) -> None:
        if self.kind == "cuda":
            torch.cuda.set_device(self.device)

    def memory_allocated(self) -> int:
        """Bytes currently held: CUDA allocator bytes, or this process's resident set size on CPU."""
        if self.kind == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return int(psutil.Process().memory_info().rss)

    def max_memory_allocated(self) -> int:
        """Peak bytes: CUDA allocator peak, or the process's peak resident set size on CPU."""
        if self.kind == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def reset_peak_memory_stats(self) -> None:
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)


def get_accelerator(local_rank: int | None = None) -> Accelerator:
    """Pick the device: ``DEEPSHARD_ACCELERATOR`` (or DeepSpeed's ``DS_ACCELERATOR``) wins, else CUDA when
    available, else CPU. On CUDA the device index is the local rank."""
    forced = os.environ.get("DEEPSHARD_ACCELERATOR") or os.environ.get("DS_ACCELERATOR")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if forced:
        if forced not in ("cpu", "cuda"):
            raise ValueError(
                f"DEEPSHARD_ACCELERATOR={forced!r} is not a known accelerator; use 'cpu' or 'cuda'")
        if forced == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("DEEPSHARD_ACCELERATOR=cuda but torch.cuda.is_available() is False; "
                               "install a CUDA build of torch or set DEEPSHARD_ACCELERATOR=cpu")
        kind = forced
    else:
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        return Accelerator("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return Accelerator("cpu", 0)
