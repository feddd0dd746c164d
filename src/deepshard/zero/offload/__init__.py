"""ZeRO-Offload and ZeRO-Infinity: model states in host memory or on disk.

Policies (``policy.py``) describe where states live; ``factory.py`` turns them into the objects the
ZeRO strategies use: the optimizer side of a shard (``states.py``, ``subgroup_states.py``) and the
ZeRO-3 parameter shard (``param_store.py``). Disk I/O is ``swapper.py``. See docs/offload.md.
"""
from deepshard.zero.offload.policy import (AioSettings, CpuOffload, NoOffload, NvmeOffload, OffloadPolicy,
                                           make_offload_policies)
from deepshard.zero.offload.swapper import AsyncSwapper, SwapError

__all__ = ["AioSettings", "AsyncSwapper", "CpuOffload", "NoOffload", "NvmeOffload", "OffloadPolicy",
           "SwapError", "make_offload_policies"]
