"""Shared memory vs pairwise TCP for CommGroup's all-gather and reduce-scatter (``comm/shm.py``).

    python -m benchmarks.shm_bench [--mib 4 16] [--slots 4] [--calls 30] [--nprocs 2]

Spawns ``nprocs`` gloo processes (one thread each) and prints, per tensor size (the full, unsharded
tensor, fp32) and collective, the median milliseconds per call over ``calls`` calls for TCP and for shared
memory with each outbox slot size in ``--slots`` (MiB). The transports take turns in blocks of five
calls, so a load change on the host hits every row alike; quote the load average with the figures.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepshard.comm.group import CommGroup

_BLOCK = 5


def _ops(comm: CommGroup, numel: int) -> dict[str, Callable[[], None]]:
    size = comm.size
    shard, full = torch.randn(numel // size), torch.randn(numel)
    out = torch.empty(numel)

    def gather() -> None:
        comm.all_gather_into_tensor(out, shard)

    def scatter() -> None:
        comm.reduce_scatter_pieces([full], numel // size).wait()

    return {"all_gather_into_tensor": gather, "reduce_scatter_pieces": scatter}


def _worker(rank: int, nprocs: int, port: int, mibs: list[float], slots: list[float], calls: int) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=nprocs)
    variants: dict[str, CommGroup] = {"tcp": CommGroup(pairwise=True, shm=False)}
    for mib in slots:  # the slot size is read at each group's rendezvous
        os.environ["DEEPSHARD_SHM_SLOT_MB"] = str(mib)
        variants[f"shm {mib:g} MiB slots"] = comm = CommGroup(pairwise=True, shm=True)
        comm.all_gather_into_tensor(torch.empty(nprocs), torch.ones(1))
    for mib in mibs:
        numel = int(mib * (1 << 20)) // 4 // nprocs * nprocs
        ops = {name: _ops(comm, numel) for name, comm in variants.items()}
        for op in ("all_gather_into_tensor", "reduce_scatter_pieces"):
            times: dict[str, list[float]] = {name: [] for name in variants}
            for name in variants:  # warm-up: first-touch page faults of fresh buffers
                ops[name][op]()
            for _ in range(-(-calls // _BLOCK)):
                for name in variants:
                    for _ in range(_BLOCK):
                        dist.barrier()
                        t = time.perf_counter()
                        ops[name][op]()
                        times[name].append(time.perf_counter() - t)
            if rank == 0:
                for name, ts in times.items():
                    print(f"{mib:g} MiB fp32  {op:24s} {name:22s} {statistics.median(ts) * 1e3:8.2f} ms")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, nargs="+", default=[4, 16])
    parser.add_argument("--slots", type=float, nargs="+", default=[4])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--nprocs", type=int, default=2)
    args = parser.parse_args()
    from benchmarks.spawn import free_port

    print(f"load average {os.getloadavg()[0]:.2f}")
    mp.spawn(_worker, args=(args.nprocs, free_port(), args.mib, args.slots, args.calls), nprocs=args.nprocs)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
