"""Does waiting on an NCCL collective hold the host? (``python -m benchmarks.gpu.nccl_wait --out f.json``)

With ~``--queue-ms`` of matrix products queued on the GPU, an all-reduce is started and waited on three
ways; the host time of each wait is reported:

- ``plain_ms``: ``work.wait()``: orders the stream, should return at once;
- ``timed_ms``: ``work.wait(timeout=...)``: torch's WorkNCCL then polls until the GPU has finished;
- ``watchdog_ms``: deepshard's collective watchdog as a group of two NCCL ranks would call it.

A ZeRO-3 step waits on every parameter group's gather and every gradient group's reduction, so a wait
that holds the host stops it from queueing the next layer's kernels while the GPU works.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _host_ms(wait: Callable[[Any], Any], queue_ms: float) -> float:
    import torch
    import torch.distributed as dist

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    a @ a
    torch.cuda.synchronize()
    one = (time.perf_counter() - t0) * 1e3
    for _ in range(max(1, int(queue_ms / max(one, 1e-3)))):
        a @ a
    x = torch.ones(1 << 20, device="cuda")
    work = dist.all_reduce(x, async_op=True)
    t0 = time.perf_counter()
    wait(work)
    took = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--queue-ms", type=float, default=200.0)
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("nccl_wait: no CUDA device")
        return 0
    from deepshard.comm.watchdog import Watchdog, WaitLimit

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))

    class _TwoRanks:  # the watchdog's view of a two-rank NCCL group (this world has one)
        rank, size, peers, group, progress, backend = 0, 2, [0, 1], None, None, "nccl"

    dog = Watchdog(_TwoRanks(), WaitLimit(600.0, "test"))  # type: ignore[arg-type]
    _host_ms(lambda w: w.wait(), 20)  # warm-up: NCCL's communicator, cuBLAS
    out = {"queue_ms": args.queue_ms,
           "plain_ms": _host_ms(lambda w: w.wait(), args.queue_ms),
           "timed_ms": _host_ms(lambda w: w.wait(timeout=datetime.timedelta(seconds=600)), args.queue_ms),
           "watchdog_ms": _host_ms(lambda w: dog.wait(w, "all_reduce"), args.queue_ms)}
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
