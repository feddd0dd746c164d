"""Pipeline benchmark: step time of ``PipelineEngine`` per schedule on ``pp`` processes (CPU, gloo) against
the same model and batch on one process, and each schedule's measured bubble against the analytic one.

    python benchmarks/pipeline_bench.py [--pp 2] [--micro-batches 8] [--steps 5] [--json out.json]

The measured bubble of a stage is ``1 - (its compute time) / (step time)``, averaged over stages; the
analytic one is the simulator's (``deepshard.pipe.simulate``) with the pass costs measured on one process.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import time
from typing import Any

HIDDEN, BLOCKS, SEQ, MICRO, VOCAB = 256, 8, 64, 4, 512


def _model(pp: int) -> Any:
    import torch.nn.functional as F
    from torch import nn

    from deepshard.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(HIDDEN)
            self.fc1, self.fc2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

        def forward(self, x: Any) -> Any:
            return x + self.fc2(F.gelu(self.fc1(self.ln(x))))

    class Embed(nn.Embedding):
        def __init__(self) -> None:
            super().__init__(VOCAB, HIDDEN)

    specs = ([TiedLayerSpec("embed", Embed)] + [LayerSpec(Block) for _ in range(BLOCKS)]
             + [TiedLayerSpec("embed", Embed, forward_fn=lambda m, x: x @ m.weight.t())])

    def loss_fn(logits: Any, labels: Any) -> Any:
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    return PipelineModule(specs, num_stages=pp, loss_fn=loss_fn, seed_layers=True, partition_method="type:block")


def _rank(rank: int, world: int, port: int, schedule: str, m: int, steps: int, out: Any) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DEEPSHARD_ACCELERATOR": "cpu"})
    import torch

    import deepshard
    from deepshard.pipe.schedule import COMPUTE

    torch.set_num_threads(1)
    model = _model(world)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": m,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "pipeline": {"schedule": schedule}}
    engine = deepshard.initialize(model=model, config=cfg)[0]
    busy = {"t": 0.0}
    per_kind: dict[str, list[float]] = {}
    for kind in COMPUTE:
        fn = engine._dispatch[kind]

        def timed(run: Any, a: Any, fn: Any = fn, kind: Any = kind) -> None:
            t0 = time.perf_counter()
            fn(run, a)
            dt = time.perf_counter() - t0
            busy["t"] += dt
            per_kind.setdefault(kind.value, []).append(dt)
        engine._dispatch[kind] = timed
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, VOCAB, (MICRO, SEQ), generator=g),) * 2 for _ in range(m)]
    times, bubbles = [], []
    for step in range(steps + 1):
        torch.distributed.barrier()
        busy["t"] = 0.0
        t0 = time.perf_counter()
        engine.train_batch(iter(data))
        dt = time.perf_counter() - t0
        if step:  # the first step warms up
            times.append(dt)
            bubbles.append(1.0 - busy["t"] / dt)
    out.put((rank, statistics.median(times), statistics.mean(bubbles),
             {k: statistics.median(v) for k, v in per_kind.items()}))
    engine.destroy()
    torch.distributed.destroy_process_group()


def run(pp: int, schedule: str, m: int, steps: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_init_and_run, args=(r, pp, port, schedule, m, steps, out)) for r in range(pp)]
    for p in procs:
        p.start()
    rows = sorted(out.get(timeout=900) for _ in procs)
    for p in procs:
        p.join()
    return {"pp": pp, "schedule": schedule, "m": m, "step_s": max(r[1] for r in rows),
            "bubble": statistics.mean(r[2] for r in rows), "pass_s": rows[0][3]}


def _init_and_run(rank: int, world: int, port: int, *args: Any) -> None:
    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _rank(rank, world, port, *args)


def main() -> None:
    from deepshard.pipe.schedule import Costs, build_schedule
    from deepshard.pipe.simulate import simulate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    m = args.micro_batches
    base = run(1, "1f1b", m, args.steps)
    rows = [base]
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        row = run(args.pp, schedule, m, args.steps)
        f, b = base["pass_s"]["F"] / args.pp, base["pass_s"]["B"] / args.pp
        costs = Costs(forward=f, backward_input=b / 2, backward_weight=b / 2)
        sim = simulate(build_schedule(schedule, args.pp, m), m, costs=costs)
        row["bubble_analytic"] = sim.bubble_fraction
        row["speedup_vs_pp1"] = base["step_s"] / row["step_s"]
        rows.append(row)
    for r in rows:
        print(f"pp={r['pp']} {r['schedule']:6s} m={r['m']}: step {r['step_s'] * 1e3:8.1f} ms  measured bubble "
              f"{r['bubble']:.3f}  analytic {r.get('bubble_analytic', 0.0):.3f}  speed-up vs pp=1 "
              f"{r.get('speedup_vs_pp1', 1.0):.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
