"""ZeRO-3 on a slow link between machines: plain ZeRO-3 against ZeRO++ (hpZ + qwZ + qgZ) and hybrid sharding
(MiCS), on 2 "nodes" x 2 processes whose inter-node link is shaped (``benchmarks/shaped_links.py``).

    sudo python benchmarks/zeropp_bench.py [--rate 1gbit] [--steps 20] [--warmup 3] [--layouts plain,zeropp,hybrid]
    sudo python benchmarks/zeropp_bench.py --steps 1000 --warmup 0 --out convergence.json   # the long run
    python benchmarks/zeropp_bench.py --unshaped --steps 1000 --warmup 0 --dim 128 --layers 2   # loss only, no root

Each layout runs in 4 fresh processes (ranks 0-1 in the first namespace, 2-3 in the second; torch elastic's
node variables ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` tell deepshard which ranks share a machine) training
the same GPT-style model (``benchmarks/workloads.TinyGPT``) on the same tokens with AdamW and clipping.
Per layout it reports: the bytes its ranks sent across the machine boundary and inside machines per step
(deepshard's comms logger, summed over the ranks), the median step time of ``--steps`` after ``--warmup``,
the measured link speeds (one 16 MiB send inside a node and one across), and the mean loss of the last
tenth of the steps (and of each tenth: ``loss_curve``), with the ratios against plain ZeRO-3. Rank 0 of
each layout prints one JSON line. ``--unshaped`` runs the same layouts, model and tokens with every process
on the loopback (no namespaces, no root): the losses and bytes are the shaped run's, the times are not.
Timings on a shared host are noisy: re-measure on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
LAYOUTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "zeropp": {"zero_hpz_partition_size": 2, "zero_quantized_weights": True, "zero_quantized_gradients": True},
    "hybrid": {"mics_shard_size": 2},
    "hpz": {"zero_hpz_partition_size": 2},
    "qwz_qgz": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
}
"""The ``zero_optimization`` keys of each layout (ZeRO stage 3 in all)."""
WORLD, PER_NODE = 4, 2


# ----------------------------------------------------------------------------------------- the worker
def _link_check(dist: Any, torch: Any, rank: int) -> dict[str, float]:
    """Seconds-derived MB/s of one 16 MiB send from rank 0 to rank 1 (same node) and to rank 2 (the other)."""
    out: dict[str, float] = {}
    data = torch.ones(4 * 1024 * 1024)
    for name, peer in (("intra_MBps", 1), ("inter_MBps", 2)):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(data, peer)
        elif rank == peer:
            dist.recv(data, 0)
        dist.barrier()
        out[name] = round(data.numel() * 4 / (time.perf_counter() - start) / 1e6, 1)
    return out


def worker(case: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    import deepshard
    from benchmarks.workloads import Workload

    torch.set_num_threads(int(case["threads"]))
    rank = int(os.environ["RANK"])
    w = Workload("gpt", "gpt", case["batch"], case["dims"], tokens_per_sample=case["dims"]["seq_len"])
    cfg = {"train_micro_batch_size_per_gpu": case["batch"] // WORLD, "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": case["lr"]}},
           "zero_optimization": {"stage": 3, **LAYOUTS[case["layout"]]}}
    engine, *_ = deepshard.initialize(model=w.build_model(seed=0), config=cfg)
    links = _link_check(dist, torch, rank)
    losses, times = [], []
    for step in range(case["warmup"] + case["steps"]):
        if step == case["warmup"]:
            engine.comms_logger.reset()
        x, y = w.batch(1, step, rank, WORLD)
        dist.barrier()
        start = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    log = engine.comms_logger
    sent = torch.tensor([float(log.inter_node_bytes()), float(log.intra_node_bytes())], dtype=torch.float64)
    dist.all_reduce(sent)
    measured = times[case["warmup"]:]
    if rank == 0:
        tenth = max(1, len(losses) // 10)
        tail = losses[-tenth:]
        curve = [round(statistics.fmean(losses[i:i + tenth]), 5) for i in range(0, len(losses), tenth)]
        print(json.dumps({"layout": case["layout"], "keys": LAYOUTS[case["layout"]], "steps": case["steps"],
                          "step_s": statistics.median(measured), "inter_bytes_per_step": sent[0].item() / case["steps"],
                          "intra_bytes_per_step": sent[1].item() / case["steps"], "final_loss": statistics.fmean(tail),
                          "first_loss": losses[0], "loss_curve": curve, "links": links, "rank0_by_op": log.link_summary(),
                          "parameters": sum(p.numel() for p in w.build_model(seed=0).parameters())}), flush=True)
    engine.destroy()


# ----------------------------------------------------------------------------------------- the driver
def run_layout(nodes: Any, addr: str, case: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Start the 4 ranks of ``case`` (2 per namespace) and return rank 0's JSON line."""
    from benchmarks.spawn import free_port
    port = free_port()  # a fresh port per run: two runs at once must not meet on one rendezvous
    procs = []
    for rank in range(WORLD):
        node = rank // PER_NODE
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank % PER_NODE), WORLD_SIZE=str(WORLD),
                   LOCAL_WORLD_SIZE=str(PER_NODE), GROUP_RANK=str(node), MASTER_ADDR=addr, MASTER_PORT=str(port),
                   GLOO_SOCKET_IFNAME=nodes.devices[node], OMP_NUM_THREADS=str(case["threads"]),
                   DEEPSHARD_ACCELERATOR="cpu", PYTHONPATH=str(REPO_ROOT), PYTHONWARNINGS="ignore")
        cmd = [*nodes.prefix(node), sys.executable, __file__, "--worker", json.dumps(case)]
        procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=timeout))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    if os.environ.get("ZEROPP_BENCH_LOG"):
        sys.stderr.write(outs[0][1][-4000:])
    rows = [json.loads(line) for line in outs[0][0].splitlines() if line.startswith("{")]
    if not rows:
        failed = next((err for p, (_, err) in zip(procs, outs) if p.returncode), outs[0][1])
        return {"layout": case["layout"], "error": failed[-3000:]}
    return rows[0]


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each layout against plain ZeRO-3: inter-node bytes, speed-up, relative loss difference."""
    base = next((r for r in rows if r.get("layout") == "plain" and "error" not in r), None)
    for row in rows:
        if base is None or "error" in row:
            continue
        row["inter_bytes_ratio"] = row["inter_bytes_per_step"] / max(base["inter_bytes_per_step"], 1.0)
        row["speedup"] = base["step_s"] / row["step_s"]
        row["loss_rel_diff"] = abs(row["final_loss"] - base["final_loss"]) / abs(base["final_loss"])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rate", default="1gbit", help="the inter-node link's bandwidth (tc syntax)")
    parser.add_argument("--delay", default="100us", help="added one-way latency (tc netem syntax; needs netem)")
    parser.add_argument("--layouts", default="plain,zeropp,hybrid", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences), divisible by 4")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // WORLD))
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--unshaped", action="store_true",
                        help="no namespaces or shaping (no root): every process on the loopback; for the losses")
    parser.add_argument("--out", help="also write the rows to this JSON file")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.shaped_links import ADDRESSES, ShapedNodes, UnshapedNodes

    dims = {"vocab": args.vocab, "dim": args.dim, "layers": args.layers, "heads": max(1, args.dim // 64),
            "seq_len": args.seq}
    rows = []
    links = UnshapedNodes() if args.unshaped else ShapedNodes(rate=args.rate, delay=args.delay)
    addr = "127.0.0.1" if args.unshaped else ADDRESSES[0]
    with links as nodes:
        print(f"# {nodes.describe()}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
        for layout in args.layouts.split(","):
            case = {"layout": layout, "steps": args.steps, "warmup": args.warmup, "dims": dims, "batch": args.batch,
                    "lr": args.lr, "threads": args.threads}
            rows.append(run_layout(nodes, addr, case, args.timeout))
            print(json.dumps(rows[-1]), flush=True)
    for row in ratios(rows):
        if "error" not in row and "speedup" in row:
            print(f"{row['layout']:>8}: inter-node bytes x{row['inter_bytes_ratio']:.3f}, step {row['step_s']:.3f} s "
                  f"(x{row['speedup']:.2f} faster), final loss {row['final_loss']:.4f} "
                  f"({100 * row['loss_rel_diff']:.2f}% from plain)")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
