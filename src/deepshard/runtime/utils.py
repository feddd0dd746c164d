"""``deepspeed.runtime.utils`` under deepshard: the helpers DeepSpeed users call from it.

- :func:`set_random_seed` seeds Python's ``random``, numpy and torch (every device) in this process.
- :func:`move_to_device` moves tensors, also inside lists, tuples and dicts, to a device.
- :func:`see_memory_usage` prints this process's accelerator and host memory (rank 0 only) when forced.
- :func:`partition_uniform` / :func:`partition_balanced` cut layers into pipeline stages
  (:mod:`deepshard.runtime.partitioning`).
"""
from __future__ import annotations

import gc
import random
from typing import Any, Callable, Optional

import psutil
import torch

from deepshard.runtime.partitioning import partition_balanced, partition_uniform, prefix_sum_inc

__all__ = ["move_to_device", "partition_balanced", "partition_uniform", "prefix_sum_inc", "see_memory_usage",
           "set_random_seed"]


def set_random_seed(seed: int) -> None:
    """Seed ``random``, numpy's global generator (``seed % 2**32``) and torch on every device
    (``seed % 2**63``), as DeepSpeed's ``set_random_seed`` does."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # numpy is optional for this helper
        numpy = None
    if numpy is not None:
        numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed % (2**63))


def move_to_device(item: Any, device: Any, criterion_func: Optional[Callable[[Any], bool]] = None) -> Any:
    """``item`` (a tensor, or lists, tuples and dicts of them, nested) on ``device``.

    With ``criterion_func``, an item it accepts is moved in place (its ``.data`` replaced) and returned;
    anything else goes through the containers; a leaf without ``.to`` (an int, a string) is returned as it is
    (DeepSpeed raises AttributeError there)."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device) if hasattr(item, "to") else item


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print ``message`` and this process's memory (accelerator allocated/reserved and their peaks in
    GB, host memory in use) when ``force``; a no-op otherwise, and on ranks other than 0. The peak
    counters are reset afterwards, so the next call reports the peak since this one."""
    if not force:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    from deepshard.accelerator import get_accelerator

    gc.collect()
    acc, gb = get_accelerator(), 1024**3
    print(message)
    print(f"MA {acc.memory_allocated() / gb:.2f} GB  Max_MA {acc.max_memory_allocated() / gb:.2f} GB  "
          f"CA {acc.memory_reserved() / gb:.2f} GB  Max_CA {acc.max_memory_reserved() / gb:.2f} GB")
    vm = psutil.virtual_memory()
    print(f"CPU Virtual Memory:  used = {(vm.total - vm.available) / gb:.2f} GB, percent = {vm.percent}%")
    acc.reset_peak_memory_stats()


def __getattr__(name: str) -> Any:
    """DeepSpeed names this module does not provide: an AttributeError that says why and what to use."""
    from deepshard.compat.aliases import missing_attribute

    raise missing_attribute(__name__, name)
