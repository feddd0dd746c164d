"""Measured tensor memory on any device, CPU included: live storage bytes and their peak.

CUDA has ``torch.cuda.max_memory_allocated``; a CPU has no allocator statistics, and the resident set
size mixes in the interpreter, libraries and freed-but-kept pages. :class:`TensorMemoryTracker` measures
what the CUDA figure measures, the bytes of live tensor storages, on any device:

* at ``__enter__`` every tensor the garbage collector can reach is found (parameters, optimizer state,
  gradients, batches) and its storage noted once, however many views share it;
* inside, a dispatch mode notes the storage of every op's output (forward, backward, collectives,
  optimizer), so temporaries are seen as they are made;
* a weak reference per storage drops it when torch frees it, and the sum is re-read after every op, so
  storages that change size in place (ZeRO-3's gathered buffers, ``untyped_storage().resize_``) count at
  their current size.

The peak is the largest sum seen after any op. Allocations inside one kernel (workspaces) and memory
that is not a tensor (communication libraries' own buffers) are not seen; on CUDA use the allocator.
"""
from __future__ import annotations

import gc
import warnings
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


class TensorMemoryTracker(TorchDispatchMode):
    """``with TensorMemoryTracker("cpu") as t: ...`` then ``t.peak_bytes`` / ``t.current_bytes``."""

    def __init__(self, device_type: str = "cpu", count_fake: bool = False) -> None:
        """``count_fake``: count only fake tensors (a dry run under ``FakeTensorMode``), else only real ones."""
        super().__init__()
        self.device_type = device_type
        self.count_fake = count_fake
        self._live: dict[int, weakref.ref] = {}
        self.peak_bytes = 0
        self.start_bytes = 0

    def _note(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != self.device_type or tensor.is_meta or _is_fake(tensor) != self.count_fake:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
            return
        key = id(storage)
        if key in self._live:
            return
        self._live[key] = weakref.ref(storage, lambda _ref, k=key: self._live.pop(k, None))

    @property
    def current_bytes(self) -> int:
        total = 0
        for ref in list(self._live.values()):
            storage = ref()
            if storage is not None:
                total += storage.nbytes()
        return total

    def _sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def __enter__(self) -> "TensorMemoryTracker":
        gc.collect()  # tensors only kept alive by unreachable cycles are not live memory
        with warnings.catch_warnings():  # isinstance() on deprecated module attributes warns
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                try:
                    if isinstance(obj, torch.Tensor):
                        self._note(obj)
                except ReferenceError:  # weak proxies
                    continue
        self.start_bytes = self.current_bytes
        self.peak_bytes = self.start_bytes
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._note(value)
        self._sample()
        return out

    def reset_peak(self) -> None:
        """Restart the peak from the bytes live now."""
        self.peak_bytes = self.current_bytes
