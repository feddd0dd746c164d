"""``deepspeed.runtime.swap_tensor``: DeepSpeed's size constant for NVMe swapping (``MIN_SWAPPABLE_BYTES``).

DeepSpeed swaps tensors of at least 1 MiB through async I/O and keeps smaller ones in memory; code (its own
tests among it) sizes models by that constant. deepshard's NVMe offload (:mod:`deepshard.zero.offload`) writes
every offloaded shard whatever its size, so the constant does not steer it; it is here under DeepSpeed's name
with DeepSpeed's value."""
from __future__ import annotations

__all__ = ["MIN_AIO_BYTES", "MIN_SWAPPABLE_BYTES"]

MIN_AIO_BYTES = 1024 ** 2
MIN_SWAPPABLE_BYTES = MIN_AIO_BYTES
