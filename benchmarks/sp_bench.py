"""Sequence parallelism on CPU (gloo): communication bytes against the formula, the longest sequence under
a per-process memory cap, and step time.

    python benchmarks/sp_bench.py [--cap-mib 120] [--skip-memory] [--skip-time]

1. Bytes: one forward and backward of a 2-layer model, counted by the comms logger (what each process hands
   to its collectives), against: Ulysses, per layer, 4 all-to-alls of this rank's q, k, v and output forward
   and 4 of their gradients backward; ring, per layer, ``ring - 1`` passes of the key/value block forward and
   ``ring - 1`` passes of block + gradient and one of the gradient backward.
2. Memory: the peak resident memory of one forward and backward above the process's resident memory
   before it (``MALLOC_MMAP_THRESHOLD_`` so freed tensors leave the process), doubling-and-halving the
   length until the cap: the longest sequence each sp size trains at the same per-process cap.
3. Step time of forward + backward on the same total tokens (on a shared machine: not a measurement to
   trust; rerun idle).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import socket
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, KV_HEADS, LAYERS, VOCAB, BATCH = 64, 4, 2, 2, 128, 1


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hd = DIM // HEADS
        self.q, self.kv, self.o = nn.Linear(DIM, DIM), nn.Linear(DIM, 2 * KV_HEADS * self.hd), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.n1, self.n2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor, sp: Any, seq_len: int) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.n1(x)
        q = self.q(h).view(b, s, HEADS, -1).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, KV_HEADS, -1).permute(2, 0, 3, 1, 4)
        x = x + self.o(sp.attention(q, k, v, seq_len).transpose(1, 2).reshape(b, s, DIM))
        return x + self.mlp(self.n2(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))

    def forward(self, ids: torch.Tensor, sp: Any, seq_len: int) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x, sp, seq_len)
        return self.head(x)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _step(model: Model, sp: Any, seq_len: int) -> None:
    ids = torch.randint(0, VOCAB, (BATCH, seq_len), generator=torch.Generator().manual_seed(0))
    batch = sp.shard_batch({"input_ids": ids, "labels": ids})
    loss = sp.loss(model(batch["input_ids"], sp, seq_len), batch["shift_labels"])
    loss.backward()


def _worker(rank: int, world: int, port: int, task: dict[str, Any], queue: Any) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import torch.distributed as dist

    from deepshard.sp import SequenceParallel
    from deepshard.topology import ParallelDims, Topology

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        topo = Topology.build(ParallelDims(sp=world))
        sp = SequenceParallel.build(topo, task["mode"], task.get("ulysses_size"))
        torch.manual_seed(0)
        model = Model()
        _step(model, sp, 8 * world)  # warm-up: imports, allocator
        topo.world.logger.reset()
        base = _rss()
        start = time.perf_counter()
        _step(model, sp, task["seq_len"])
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
        queue.put((rank, {"ops": topo.world.logger.summary(), "peak": peak, "seconds": seconds}))
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        queue.put((rank, {"error": repr(exc)}))
    finally:
        dist.destroy_process_group()


def run(world: int, task: dict[str, Any]) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _port()
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))}
    os.environ.update(env)
    procs = [ctx.Process(target=_worker, args=(r, world, port, task, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=900) for _ in procs)
    for p in procs:
        p.join()
    out = [results[r] for r in range(world)]
    errors = [o["error"] for o in out if "error" in o]
    if errors:
        raise RuntimeError(f"{world} x {task}: {errors[0]}")
    return out


def formula_bytes(mode: str, world: int, seq_len: int, ulysses: int | None = None) -> dict[str, int]:
    """Bytes per process for one forward + backward (fp32): this rank's tokens ``local`` (the layout's,
    padding included) and the heads after the head plan (``hq`` query, ``hk`` key/value)."""
    from deepshard.sp.heads import head_plan
    from deepshard.sp.layout import SeqLayout

    u = {"ulysses": world, "ring": 1, "hybrid": ulysses or 1}[mode]
    ring = world // u
    local = SeqLayout(seq_len, ring=ring, ulysses=u).local_len
    plan = head_plan(HEADS, KV_HEADS, u)
    hq, hk = HEADS + plan.pad, KV_HEADS * plan.kv_repeat + plan.pad
    hd, word = DIM // HEADS, 4
    out: dict[str, int] = {}
    if u > 1:  # q, k, v and the output forward; their gradients backward
        out["all_to_all"] = LAYERS * 2 * BATCH * local * hd * (2 * hq + 2 * hk) * word
    if ring > 1:  # a block is k and v of the ring shard (local * u tokens, hk / u heads)
        block = 2 * BATCH * (hk // u) * (local * u) * hd * word
        out["ring_send"] = LAYERS * block * ((ring - 1) + 2 * (ring - 1) + 1)
    return out


def bytes_table(seq_len: int) -> list[dict[str, Any]]:
    rows = []
    for mode, world, u in (("ulysses", 2, None), ("ulysses", 4, None), ("ring", 2, None), ("ring", 4, None),
                           ("hybrid", 4, 2)):
        result = run(world, {"mode": mode, "ulysses_size": u, "seq_len": seq_len})[0]
        measured: dict[str, int] = {}
        for op, stats in result["ops"].items():
            for kind in ("all_to_all", "ring_send"):
                if op.endswith(kind):
                    measured[kind] = measured.get(kind, 0) + stats["bytes"]
        want = formula_bytes(mode, world, seq_len, u)
        rows.append({"mode": mode, "sp": world, "ulysses": u, "measured": measured, "formula": want,
                     "ratio": {k: measured.get(k, 0) / v for k, v in want.items()}})
    return rows


def longest(world: int, mode: str, cap: int, start: int) -> tuple[int, int]:
    """The longest length (a multiple of 256) whose peak stays under ``cap`` bytes on every rank, and its
    peak. The peak grows about linearly with the length, so each next length is read off the line through
    the two measurements nearest the cap (bisection when that falls outside the bracket)."""
    peaks: dict[int, int] = {}

    def measure(length: int) -> None:
        peaks[length] = max(r["peak"] for r in run(world, {"mode": mode, "seq_len": length}))
        print(f"  {mode} sp={world} {length} tokens: peak {peaks[length] / 2**20:.1f} MiB", flush=True)

    measure(start)
    while True:
        good = max((n for n, p in peaks.items() if p <= cap), default=0)
        bad = min((n for n, p in peaks.items() if p > cap), default=None)
        if bad is not None and bad - good <= 256:
            return good, peaks.get(good, 0)
        near = sorted(peaks, key=lambda n: abs(peaks[n] - cap))[:2]
        if len(near) == 2 and peaks[near[0]] != peaks[near[1]]:
            (n1, p1), (n2, p2) = ((n, peaks[n]) for n in near)
            guess = int(n1 + (cap - p1) * (n2 - n1) / (p2 - p1)) // 256 * 256
        else:  # one point: the peak taken as proportional to the length
            (n1, p1), = peaks.items()
            guess = int(n1 * cap / max(p1, 1)) // 256 * 256
        guess = max(guess, good + 256)  # strictly inside the bracket
        if bad is not None:
            guess = min(guess, bad - 256)
        if guess in peaks or guess < 256:
            return good, peaks.get(good, 0)
        measure(guess)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cap-mib", type=int, default=120)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--skip-bytes", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--memory-cases", default="ulysses:1,ulysses:2,ulysses:4,ring:2,ring:4",
                        help="mode:processes pairs for the memory search")
    args = parser.parse_args()
    report: dict[str, Any] = {"bytes": [] if args.skip_bytes else bytes_table(args.seq)}
    for row in report["bytes"]:
        print(json.dumps(row), flush=True)
    if not args.skip_memory:
        cap = args.cap_mib << 20
        report["memory"] = {}
        for mode, world in ((m, int(w)) for m, w in (c.split(":") for c in args.memory_cases.split(","))):
            report["memory"][f"{mode} sp{world}"] = longest(world, mode, cap, 3072 * world)
            print(f"{mode} sp={world}: longest {report['memory'][f'{mode} sp{world}'][0]} tokens under "
                  f"{args.cap_mib} MiB", flush=True)
    if not args.skip_time:
        total = 4096
        for world, mode in ((1, "ulysses"), (2, "ulysses"), (2, "ring"), (4, "ring")):
            seconds = max(r["seconds"] for r in run(world, {"mode": mode, "seq_len": total}))
            print(f"step {mode} sp={world}: {seconds:.3f} s for {total} tokens (shared machine: indicative only)")


if __name__ == "__main__":
    main()
