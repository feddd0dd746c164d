"""ZeRO-Infinity benchmark: ZeRO-3 with the parameter shard and the optimizer states on disk.

    python benchmarks/offload_bench.py                  # ~400M parameters, 2 processes: nvme vs in memory
    python benchmarks/offload_bench.py --params 50e6    # quicker
    python benchmarks/offload_bench.py --headline       # model states >= 1.5x this machine's RAM, nvme only
    python benchmarks/offload_bench.py --dtype fp32 --repeats 3   # 400M fp32, defaults: memory/nvme interleaved, median ratio

Each mode runs in fresh processes (gloo). The model is a stack of residual MLP blocks (LayerNorm,
Linear h->4h, GELU, Linear 4h->h), built under ``deepshard.zero.Init`` so no process ever holds all of
it, trained in bf16 with fp32 AdamW (torch's fused CPU kernel) on random data. Reported per process:
peak resident memory of the train phase (the kernel's high-water mark, reset after set-up), the step
time (median after one warm-up step), the bytes the swapper read and wrote per step (logical) next to
what reached the storage device (``/proc/self/io``: page-cache hits are not disk reads), and the disk's
sequential bandwidth measured first in the same directory. Not a timed test: a report.

Disk use is checked first: the run refuses to take more than half of the free space.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

GiB = 2**30
DISK_BYTES_PER_PARAM = 16  # bf16: shard 2 + fp32 master 4 + Adam 8 + gradient shard 2 (grads.swp at stage 3
#                            with nvme optimizer offload); fp32: shard 4 + Adam 8 + gradient shard 4
STATE_BYTES_PER_PARAM = 16  # mixed-precision Adam model states (ZeRO paper)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=400e6, help="target parameter count (default 400e6)")
    p.add_argument("--hidden", type=int, default=0, help="model width (default: 2048, 4096 for --headline)")
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--nvme-path", default="/tmp/deepshard-offload-bench")
    p.add_argument("--sub-group-size", type=float, default=0,
                   help="zero_optimization.sub_group_size; 0 (default): left out, deepshard sizes it from memory")
    p.add_argument("--buffer-count", type=int, default=0,
                   help="offload_optimizer.buffer_count; 0 (default): left out, deepshard picks it")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="training precision")
    p.add_argument("--no-init", action="store_true",
                   help="build the whole model in every process (no zero.Init) before deepshard.initialize")
    p.add_argument("--aio-threads", type=int, default=2)
    p.add_argument("--aio-block-size", type=int, default=8 << 20)
    p.add_argument("--no-fused", action="store_true", help="torch's single-tensor AdamW instead of the fused kernel")
    p.add_argument("--modes", nargs="+", choices=["memory", "nvme"], default=["memory", "nvme"])
    p.add_argument("--headline", action="store_true",
                   help="size the model so its states are >= 1.5x this machine's RAM; nvme only, 1 timed step")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the modes this many times, interleaved (memory, nvme, memory, ...); the report gives "
                        "each run's nvme / memory ratio and their median")
    p.add_argument("--out", default="", help="write the results as JSON here")
    p.add_argument("--timeout", type=float, default=3600.0)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------- model
def model_shape(args: argparse.Namespace) -> tuple[int, int]:
    """(hidden, blocks) giving at least ``args.params`` parameters (8h^2 + 7h per block)."""
    hidden = args.hidden or (4096 if args.headline else 2048)
    target = args.params
    if args.headline:
        target = max(target, 1.5 * psutil.virtual_memory().total / STATE_BYTES_PER_PARAM)
    per_block = 8 * hidden * hidden + 7 * hidden
    return hidden, max(1, math.ceil(target / per_block))


def build_model(hidden: int, blocks: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(hidden)
            self.up = nn.Linear(hidden, 4 * hidden)
            self.down = nn.Linear(4 * hidden, hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return torch.nn.functional.mse_loss(x.float(), y.float())

    return Net()


def ds_config(args: argparse.Namespace, mode: str, path: Path) -> dict[str, Any]:
    hidden, _ = model_shape(args)
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0,
                            "stage3_prefetch_bucket_size": 4 * hidden * hidden}  # the next Linear
    if args.sub_group_size:
        zero["sub_group_size"] = int(args.sub_group_size)
    if mode == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(path)}
        if args.buffer_count:
            zero["offload_optimizer"]["buffer_count"] = args.buffer_count
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(path)}
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "fused": not args.no_fused}},
            "bf16": {"enabled": args.dtype == "bf16"}, "gradient_clipping": 1.0, "steps_per_print": 10**9,
            "zero_optimization": zero,
            "aio": {"block_size": args.aio_block_size, "queue_depth": 8, "thread_count": args.aio_threads}}


# ---------------------------------------------------------------------------------------- worker
def _proc_io() -> tuple[int, int]:
    try:
        io = psutil.Process().io_counters()
        return int(io.read_bytes), int(io.write_bytes)
    except (AttributeError, psutil.Error):
        return 0, 0


def _swap_counters(engine: Any) -> tuple[int, int]:
    read = written = 0
    s = engine.strategy
    for backing in (getattr(s.states, "backing", None), getattr(s.param_store, "backing", None),
                    getattr(s.frozen_store, "backing", None)):
        swapper = getattr(backing, "swapper", None)
        if swapper is not None:
            read += swapper.bytes_read
            written += swapper.bytes_written
    return read, written


def worker(rank: int, args: argparse.Namespace, mode: str, port: int, path: str, results: Any) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.nprocs),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DEEPSHARD_ACCELERATOR": "cpu"})
    try:
        results.put((rank, _train(rank, args, mode, Path(path))))
    except BaseException as err:  # noqa: BLE001 - the driver reports it
        import traceback

        results.put((rank, {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}))


def _train(rank: int, args: argparse.Namespace, mode: str, path: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import deepshard
    from benchmarks.measure import PeakRSS

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nprocs))
    dist.init_process_group("gloo", rank=rank, world_size=args.nprocs)
    hidden, blocks = model_shape(args)
    t0 = time.perf_counter()
    torch.manual_seed(0)  # the same model in every mode
    if args.no_init:
        model = build_model(hidden, blocks)
    else:
        with deepshard.zero.Init(dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32):
            model = build_model(hidden, blocks)
    psi = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    engine, *_ = deepshard.initialize(model=model, config=ds_config(args, mode, path))
    setup_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.micro_batch, 16, hidden, generator=g)
    y = torch.randn(args.micro_batch, 16, hidden, generator=g)
    if args.dtype == "bf16":  # inputs reach the model as given (as in DeepSpeed): in its dtype
        x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
    steps: list[dict[str, float]] = []
    peak = PeakRSS()
    for i in range(args.steps + 1):
        if i == 1:
            peak.reset()  # the warm-up step created the optimizer state; measure the steady state
        sr, sw = _swap_counters(engine)
        dr, dw = _proc_io()
        cpu0 = time.process_time()  # every thread of the process: compute, gloo, swap I/O
        start = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        mid = time.perf_counter()
        engine.step()
        end = time.perf_counter()
        sr2, sw2 = _swap_counters(engine)
        dr2, dw2 = _proc_io()
        steps.append({"step_s": end - start, "fwd_bwd_s": mid - start, "optimizer_s": end - mid,
                      "cpu_s": time.process_time() - cpu0,
                      "loss": float(loss.detach()), "swap_read": sr2 - sr, "swap_written": sw2 - sw,
                      "disk_read": dr2 - dr, "disk_written": dw2 - dw})
        if rank == 0:
            print(f"[{mode}] step {i}: {end - start:.1f}s (optimizer {end - mid:.1f}s), swap read "
                  f"{(sr2 - sr) / GiB:.2f} GiB written {(sw2 - sw) / GiB:.2f} GiB", flush=True)
    report = engine.memory_report()
    peak_bytes = peak.peak() if args.steps else psutil.Process().memory_info().rss
    engine.destroy()
    dist.destroy_process_group()
    return {"psi": psi, "hidden": hidden, "blocks": blocks, "setup_s": setup_s, "steps": steps,
            "peak_rss": peak_bytes, "peak_method": peak.method, "memory_report": report}


# ---------------------------------------------------------------------------------------- driver
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_mode(args: argparse.Namespace, mode: str, path: Path) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    os.environ.update({"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"})
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args, mode, port, str(path), results)) for r in range(args.nprocs)]
    for p in procs:
        p.start()
    out: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + args.timeout
    try:
        while len(out) < args.nprocs and time.monotonic() < deadline:
            try:
                rank, value = results.get(timeout=2.0)
                out[rank] = value
            except Exception:  # noqa: BLE001 - queue.Empty: check the processes
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out.get(r, {"error": "no result (crashed or timed out)"}) for r in range(args.nprocs)]


def disk_bandwidth(path: Path, nbytes: int = 1 << 30, block: int = 8 << 20) -> dict[str, float]:
    """Sequential write (with fsync) and read (after dropping the file's cached pages) in ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    target = path / "bandwidth.tmp"
    data = os.urandom(block)
    fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        start = time.perf_counter()
        for off in range(0, nbytes, block):
            os.pwrite(fd, data, off)
        os.fsync(fd)
        write_s = time.perf_counter() - start
        os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
        buf = bytearray(block)
        start = time.perf_counter()
        for off in range(0, nbytes, block):
            os.preadv(fd, [buf], off)
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        target.unlink(missing_ok=True)
    return {"write_GBps": nbytes / write_s / 1e9, "read_GBps": nbytes / read_s / 1e9}


def check_disk(path: Path, psi: int) -> int:
    path.mkdir(parents=True, exist_ok=True)
    need = psi * DISK_BYTES_PER_PARAM
    free = shutil.disk_usage(path).free
    if need > free // 2:
        raise SystemExit(f"the swap files need {need / GiB:.1f} GiB ({psi / 1e9:.2f}B parameters x "
                         f"{DISK_BYTES_PER_PARAM} bytes) but only {free / GiB:.1f} GiB are free in {path}; this "
                         "benchmark uses at most half of the free space: pick a smaller --params or another "
                         "--nvme-path")
    return need


def summarize(mode: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    if any("error" in r for r in ranks):
        return {"mode": mode, "error": [r.get("traceback", r["error"]) for r in ranks if "error" in r]}
    per_rank = [r["steps"][1:] or r["steps"] for r in ranks]  # timed steps (the warm-up when there are none)
    timed = per_rank[0]

    def med(key: str) -> float:
        """The median over processes of the mean per timed step."""
        return statistics.median(statistics.mean(s[key] for s in steps) for steps in per_rank)

    return {"mode": mode, "psi": ranks[0]["psi"], "hidden": ranks[0]["hidden"], "blocks": ranks[0]["blocks"],
            "setup_s": max(r["setup_s"] for r in ranks), "step_s": statistics.median(s["step_s"] for s in timed),
            "optimizer_s": statistics.median(s["optimizer_s"] for s in timed),
            "fwd_bwd_s": statistics.median(s["fwd_bwd_s"] for s in timed), "cpu_s": med("cpu_s"),
            "loadavg": os.getloadavg()[0],
            "peak_rss_per_rank": [r["peak_rss"] for r in ranks], "peak_method": ranks[0]["peak_method"],
            "swap_read_per_step": med("swap_read"), "swap_written_per_step": med("swap_written"),
            "disk_read_per_step": med("disk_read"), "disk_written_per_step": med("disk_written"),
            "losses": [s["loss"] for s in ranks[0]["steps"]], "memory_report": ranks[0]["memory_report"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.headline:
        args.modes, args.steps = ["nvme"], min(args.steps, 1)
    hidden, blocks = model_shape(args)
    psi = blocks * (8 * hidden * hidden + 7 * hidden)
    path = Path(args.nvme_path)
    need = check_disk(path, psi) if "nvme" in args.modes else 0
    ram = psutil.virtual_memory().total
    print(f"model: {blocks} blocks x hidden {hidden} = {psi / 1e6:.0f}M parameters, model states "
          f"{psi * STATE_BYTES_PER_PARAM / GiB:.1f} GiB (RAM {ram / GiB:.1f} GiB), on disk {need / GiB:.1f} GiB, "
          f"{args.nprocs} processes", flush=True)
    bandwidth = disk_bandwidth(path) if "nvme" in args.modes else {}
    if bandwidth:
        print(f"disk: sequential write {bandwidth['write_GBps']:.2f} GB/s, read {bandwidth['read_GBps']:.2f} GB/s",
              flush=True)
    rows = []
    for repeat in range(max(args.repeats, 1)):
        for mode in args.modes:
            rows.append(summarize(mode, run_mode(args, mode, path)))
            rows[-1]["repeat"] = repeat
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "memory_report"}, indent=1), flush=True)
        report([r for r in rows if r["repeat"] == repeat], bandwidth, args.nprocs)
    report_repeats(rows)
    if args.out:
        Path(args.out).write_text(json.dumps({"bandwidth": bandwidth, "rows": rows}, indent=1))
    return 1 if any("error" in r for r in rows) else 0


def report(rows: list[dict[str, Any]], bandwidth: dict[str, float], nprocs: int) -> None:
    ok = {r["mode"]: r for r in rows if "error" not in r}
    for r in rows:
        if "error" in r:
            print(f"{r['mode']}: FAILED\n" + "\n".join(r["error"]))
            continue
        peak = max(r["peak_rss_per_rank"]) / GiB
        line = (f"{r['mode']:>6}: step {r['step_s']:.2f}s (optimizer {r['optimizer_s']:.2f}s, CPU {r['cpu_s']:.2f}s), "
                f"peak RSS per process {peak:.2f} GiB")
        if r["mode"] == "nvme":
            io = r["swap_read_per_step"] + r["swap_written_per_step"]
            line += (f", per process per step: swap read {r['swap_read_per_step'] / GiB:.2f} GiB, written "
                     f"{r['swap_written_per_step'] / GiB:.2f} GiB (device: read {r['disk_read_per_step'] / GiB:.2f}, "
                     f"written {r['disk_written_per_step'] / GiB:.2f} GiB)")
            if bandwidth:
                read_s = nprocs * r["disk_read_per_step"] / (bandwidth["read_GBps"] * 1e9)
                write_s = nprocs * r["disk_written_per_step"] / (bandwidth["write_GBps"] * 1e9)
                achieved = nprocs * (r["disk_read_per_step"] + r["disk_written_per_step"]) / r["step_s"] / 1e9
                line += (f"; the {nprocs} processes' device I/O takes {read_s:.1f}s (read) + {write_s:.1f}s (write) "
                         f"at the measured bandwidth, {achieved:.2f} GB/s achieved "
                         f"(swap traffic {io / GiB:.2f} GiB/process; the rest hit the page cache)")
        print(line)
    if "memory" in ok and "nvme" in ok:
        a, b = ok["nvme"]["losses"], ok["memory"]["losses"]
        diff = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
        print(f"nvme / memory step time: {ok['nvme']['step_s'] / ok['memory']['step_s']:.2f}x; losses "
              + ("identical" if a == b else f"differ by up to {diff:.1e} relative (torch's fused AdamW "
                 "rounds the last elements of each tensor differently, and offload cuts the shard into "
                 "more tensors)"))


def report_repeats(rows: list[dict[str, Any]]) -> None:
    """With several interleaved runs: each run's wall and CPU time per step with the load average, each
    run's nvme / memory step-time ratio, and their median."""
    pairs: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if "error" not in r:
            pairs.setdefault(r["repeat"], {})[r["mode"]] = r
    ratios = [p["nvme"]["step_s"] / p["memory"]["step_s"] for p in pairs.values() if {"nvme", "memory"} <= p.keys()]
    if len(pairs) < 2:
        return
    for k, p in sorted(pairs.items()):
        print(f"run {k + 1}: " + ", ".join(f"{m} step {r['step_s']:.2f}s CPU {r['cpu_s']:.2f}s "
                                          f"(load {r['loadavg']:.1f})" for m, r in p.items()))
    if ratios:
        print(f"nvme / memory step time over {len(ratios)} interleaved runs: "
              + ", ".join(f"{x:.2f}" for x in ratios) + f"; median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    sys.exit(main())
