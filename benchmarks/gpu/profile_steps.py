"""Where a training step's time goes: a few steps under ``torch.profiler``, reduced to figures that
separate work the device does from time it waits on the host.

``profile_steps(step, batches, path)`` runs ``step`` on each batch under the profiler and writes two
operator tables (by self device time and by self host time) to ``path``; it returns, per step:

- ``wall_ms``: host wall time (each step ends by reading the loss);
- ``device_busy_ms``: the union of the device's kernel and copy intervals (what the device did);
- ``device_idle_share``: 1 - busy / wall: the share of the step the device waited for the host;
- ``kernels``, ``memcpy``, ``memset``: how many of each the device ran, and ``memcpy_ms``;
- ``syncs``: host calls that wait for the device (stream/event/device synchronize);
- ``top_device`` / ``top_host``: the ten operators with the most self time on each side.

Comparing two engines on the same batches shows whether one is behind because its device does more
(copies, extra kernels) or because its device waits (host-side overhead, synchronizations).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length (ms) covered by ``intervals`` given in microseconds."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total / 1e3


def _top(averages: Any, attr: str, n: int = 10) -> list[dict[str, Any]]:
    rows = sorted(averages, key=lambda e: getattr(e, attr, 0.0), reverse=True)[:n]
    return [{"name": e.key[:90], "ms": round(getattr(e, attr, 0.0) / 1e3, 3), "calls": e.count} for e in rows
            if getattr(e, attr, 0.0) > 0]


def profile_steps(step: Callable[[Any, Any], Any], batches: Iterable[tuple[Any, Any]], path: Path,
                  device: str) -> dict[str, Any]:
    import time

    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    batches = list(batches)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for x, y in batches:
            float(step(x, y).detach())
        wall = (time.perf_counter() - t0) * 1e3
    n = max(len(batches), 1)
    events = prof.events()
    on_device = [e for e in events if e.device_type == DeviceType.CUDA]
    busy = _union_ms([(e.time_range.start, e.time_range.end) for e in on_device])
    copies = [e for e in on_device if "memcpy" in e.name.lower()]
    averages = prof.key_averages()
    out = {"steps": n, "wall_ms": wall / n, "device_busy_ms": busy / n,
           "device_idle_share": (1 - busy / wall) if on_device and wall > 0 else None,
           "kernels": sum(1 for e in on_device if "memcpy" not in e.name.lower()
                          and "memset" not in e.name.lower()) / n,
           "memcpy": len(copies) / n, "memcpy_ms": sum(e.time_range.elapsed_us() for e in copies) / 1e3 / n,
           "memset": sum(1 for e in on_device if "memset" in e.name.lower()) / n,
           "syncs": sum(1 for e in events if e.name in SYNC_CALLS) / n,
           "top_device": _top(averages, "self_device_time_total") if on_device else [],
           "top_host": _top(averages, "self_cpu_time_total")}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        if on_device:
            f.write(averages.table(sort_by="self_device_time_total", row_limit=50, max_name_column_width=80))
            f.write("\n\n")
        f.write(averages.table(sort_by="self_cpu_time_total", row_limit=50, max_name_column_width=80))
    if device == "cuda":
        torch.cuda.synchronize()
    return out
