"""What the benchmark measures in each process: peak resident memory, bytes handed to collectives, and
the bytes of live tensors.

- Peak RSS of the train phase: the kernel's high-water mark (``VmHWM`` in /proc/self/status) after
  resetting it by writing ``5`` to /proc/self/clear_refs once set-up is done; where that file cannot be
  written, a background thread samples the RSS with psutil every few milliseconds instead. The driver
  starts workers with ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc returns freed tensors to the
  kernel and the RSS tracks the live tensors.
- Bytes communicated: engines whose collectives are issued from Python (FSDP2, DeepSpeed) are counted
  by wrapping the ``torch.distributed`` collective functions (``CollectiveCounter``); torch DDP issues
  its all-reduces from C++, so it is counted by a DDP communication hook (``ddp_counting_hook``);
  deepshard is read from its own comms logger. All three use the ZeRO paper's accounting, the same as
  deepshard's ``CommsLogger``: an all-reduce moves 2x its tensor, an all-gather or reduce-scatter 1x
  the full (unsharded) tensor, a broadcast 1x.
- Live tensor bytes: every tensor the Python garbage collector can see, each storage counted once. It
  covers what an engine keeps in Python objects (parameters, gradients, optimizer states, master
  weights, flat buffers); tensors held only by C++ (DDP's own buckets when gradients are not bucket
  views) are invisible to it.
"""
from __future__ import annotations

import gc
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import psutil
import torch


# ---------------------------------------------------------------------------------------- memory
def current_rss() -> int:
    """This process's resident set size in bytes."""
    return int(psutil.Process().memory_info().rss)


def _read_vmhwm() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakRSS:
    """The peak RSS since ``reset()``: the kernel high-water mark, or a sampling thread as fallback."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.method = "none"
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def reset(self) -> None:
        """Forget the peak so far (call it after set-up, before the first training step)."""
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            if _read_vmhwm() is not None:
                self.method = "VmHWM after clear_refs"
                return
        except OSError:
            pass
        self.method = f"psutil sampling every {self.interval_s * 1e3:g} ms"
        self._peak = current_rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        proc = psutil.Process()
        while not self._stop.is_set():
            self._peak = max(self._peak, int(proc.memory_info().rss))
            time.sleep(self.interval_s)

    def peak(self) -> int:
        """Peak bytes since ``reset()`` (stops the sampler if one runs)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            return max(self._peak, current_rss())
        value = _read_vmhwm()
        return value if value is not None else current_rss()


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the garbage collector can reach."""
    gc.collect()
    seen: set[int] = set()
    total = 0
    for obj in gc.get_objects():
        try:
            if not torch.is_tensor(obj) or obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):
            continue  # wrapper subclasses (DTensor): their local tensors are counted themselves
        if ptr == 0 or ptr in seen:
            continue
        seen.add(ptr)
        total += storage.nbytes()
    return total


# ------------------------------------------------------------------------------------ communication
@dataclass
class CommCount:
    """Per-op counters in the ZeRO accounting (see the module docstring)."""

    ops: dict[str, dict[str, int]] = field(default_factory=dict)

    def record(self, op: str, elements: int, element_size: int, factor: int) -> None:
        s = self.ops.setdefault(op, {"calls": 0, "elements": 0, "bytes": 0, "volume_elements": 0,
                                     "volume_bytes": 0})
        s["calls"] += 1
        s["elements"] += elements
        s["bytes"] += elements * element_size
        s["volume_elements"] += elements * factor
        s["volume_bytes"] += elements * element_size * factor

    def total(self, key: str) -> int:
        return sum(s[key] for s in self.ops.values())

    def reset(self) -> None:
        self.ops.clear()


def _first(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, *names: str) -> Any:
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return args[index] if len(args) > index else None


def _size(tensors: Any) -> tuple[int, int]:
    if torch.is_tensor(tensors):
        return tensors.numel(), tensors.element_size()
    items = [t for t in tensors if torch.is_tensor(t)]
    return sum(t.numel() for t in items), (items[0].element_size() if items else 0)


# op -> (ZeRO volume factor, function picking the full tensor(s) out of the call's arguments)
_OPS: dict[str, tuple[int, Callable[[tuple[Any, ...], dict[str, Any]], Any]]] = {
    "all_reduce": (2, lambda a, k: _first(a, k, 0, "tensor")),
    "all_reduce_coalesced": (2, lambda a, k: _first(a, k, 0, "tensors")),
    "all_gather_single": (1, lambda a, k: _first(a, k, 0, "output_tensor", "output")),
    "all_gather_into_tensor": (1, lambda a, k: _first(a, k, 0, "output_tensor", "output")),
    "_all_gather_base": (1, lambda a, k: _first(a, k, 0, "output_tensor", "output")),
    "all_gather": (1, lambda a, k: _first(a, k, 0, "tensor_list")),
    "reduce_scatter_single": (1, lambda a, k: _first(a, k, 1, "input", "input_tensor")),
    "reduce_scatter_tensor": (1, lambda a, k: _first(a, k, 1, "input", "input_tensor")),
    "_reduce_scatter_base": (1, lambda a, k: _first(a, k, 1, "input", "input_tensor")),
    "reduce_scatter": (1, lambda a, k: _first(a, k, 1, "input_list")),
    "broadcast": (1, lambda a, k: _first(a, k, 0, "tensor")),
    "reduce": (1, lambda a, k: _first(a, k, 0, "tensor")),
    "all_to_all_single": (1, lambda a, k: _first(a, k, 1, "input")),
}


class CollectiveCounter:
    """Wraps the ``torch.distributed`` collectives of this process to count their bytes.

    Both ``torch.distributed.X`` and ``torch.distributed.distributed_c10d.X`` are replaced, so code that
    looks either up at call time is counted. A collective implemented by calling another (torch 2.13's
    ``all_gather_into_tensor`` calls ``all_gather_single``) is counted once: only the outermost call
    on a thread counts. Install it before the engine is built (DeepSpeed binds its all-gather function
    at initialization).
    """

    def __init__(self) -> None:
        self.count = CommCount()
        self.enabled = True
        self._local = threading.local()
        self._saved: list[tuple[Any, str, Any]] = []

    def install(self) -> "CollectiveCounter":
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, (factor, pick) in _OPS.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapper = self._wrap(name, original, factor, pick)
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    self._saved.append((module, name, original))
                    setattr(module, name, wrapper)
        return self

    def uninstall(self) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    def _wrap(self, name: str, original: Callable[..., Any], factor: int,
              pick: Callable[[tuple[Any, ...], dict[str, Any]], Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if depth == 0 and self.enabled:
                tensors = pick(args, kwargs)
                if tensors is not None:
                    elements, size = _size(tensors)
                    self.count.record(name, elements, size, factor)
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth

        counted.__wrapped__ = original  # type: ignore[attr-defined]
        return counted


def ddp_counting_hook(count: CommCount) -> Callable[[Any, Any], Any]:
    """A DDP communication hook: count the bucket (2x, an all-reduce), then DDP's default all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(process_group: Any, bucket: Any) -> Any:
        buffer = bucket.buffer()
        count.record("all_reduce", buffer.numel(), buffer.element_size(), 2)
        return default_hooks.allreduce_hook(process_group, bucket)

    # DDP checks the annotations as objects; this module's are strings (postponed evaluation)
    import torch.distributed as dist

    hook.__annotations__ = {"process_group": Any, "bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}
    return hook


def time_collectives(numel: int, repeats: int = 3) -> dict[str, float]:
    """Seconds per call of each collective on ``numel`` fp32 elements (the full tensor), in the current
    default process group: the cost of the backend itself, which bounds what any engine can do."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.randn(numel - numel % world)
    shard = torch.empty(full.numel() // world)
    gathered = torch.empty_like(full)
    calls: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: dist.reduce_scatter_single(shard, full),
        "all_gather": lambda: dist.all_gather_single(gathered, full[rank * shard.numel():][:shard.numel()].clone()),
        "broadcast": lambda: dist.broadcast(full, 0),
    }
    from deepshard.comm.group import CommGroup

    pair = CommGroup(pairwise=True, shm=False)  # deepshard's pairwise forms over gloo's TCP
    calls["reduce_scatter (deepshard pairwise TCP)"] = lambda: pair.reduce_scatter_tensor(shard, full)
    calls["all_gather (deepshard pairwise TCP)"] = lambda: pair.all_gather_into_tensor(gathered, shard)
    from deepshard.comm import settings

    if settings.mode_from(None, os.environ) is not False:  # what deepshard uses on one host (comm/shm.py)
        local = CommGroup(pairwise=True)
        calls["reduce_scatter (deepshard shared memory)"] = lambda: local.reduce_scatter_tensor(shard, full)
        calls["all_gather (deepshard shared memory)"] = lambda: local.all_gather_into_tensor(gathered, shard)
    out = {}
    for name, call in calls.items():
        call()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        dist.barrier()
        out[name] = (time.perf_counter() - start) / repeats
    return out
