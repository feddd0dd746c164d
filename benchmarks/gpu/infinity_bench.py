"""ZeRO-Infinity on one GPU: parameters and optimizer states in host memory or on disk, a model several
times larger than what trains on the same GPU memory without offload.

    python -m benchmarks.gpu.infinity_bench --out infinity.json            # on a GPU machine
    python -m benchmarks.gpu.infinity_bench --device cpu --size tiny       # checks the script on a CPU

What runs, in this order, each case in a fresh process with its own time limit, until ``--budget``
seconds are spent:

1. CPU Adam throughput: one AdamW step over ``--adam-params`` fp32 parameters in 16M-element tensors,
   torch's ``AdamW`` (foreach, then fused) against deepshard's ``DeepSpeedCPUAdam``; parameters/s, the
   median of 3 steps after one warm-up, all cores.
2. Without offload (ZeRO-3, bf16, everything on the GPU): the largest GPT depth that trains under the
   GPU memory cap (``--gpu-cap-gib``, ``torch.cuda.set_per_process_memory_fraction``), found by trying
   the formula's depth and its neighbours; the first depth that runs out of memory is recorded too.
3. With offload at >= 3x those parameters: ``offload_param`` and ``offload_optimizer`` to ``cpu``
   (pinned host memory), then to ``nvme`` (files under ``--nvme-path``; shallower where half the free
   disk would not hold it, its multiple recorded), then ``cpu`` at 6x and 10x while host memory and
   the budget allow: the largest that trains is the headline.

Why a cap: the machine this was written for has one 80 GiB (or 141 GiB) GPU, 128 GiB of host memory
and 64 GiB of disk. Mixed-precision Adam keeps 16 bytes per parameter, so without offload the GPU holds
~4.5B (~8B) parameters, and 3x that (13.5B, 24B) needs 216 GiB (384 GiB) of host memory and disk: more
than the machine has. Under a cap the same ratio is measured with sizes the host can hold.

Per training case: set-up time, step time (median of the timed steps), tokens/s, peak GPU and host
memory, the losses, and one extra step under ``torch.profiler``: GPU compute (kernels), GPU copies
(memcpy), and the time forward + backward waited on anything but its own kernels (its wall time less
the kernels' time: parameter fetches, gradient offload, host hooks). The optimizer step on the CPU is
its own column.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.common import (GiB, GPTShape, as_dict, case_main, cuda_available, gpt_batches,  # noqa: E402
                                   init_single_process_group, run_case, stop_on_signals,
                                   synchronize)

MODULE = "benchmarks.gpu.infinity_bench"
DIM, HEADS, VOCAB, SEQ = 2048, 16, 32000, 1024
TINY = {"dim": 64, "heads": 2, "vocab": 256, "seq_len": 32}
STATE_BYTES = 16  # bf16 parameter + bf16 gradient + fp32 master + Adam m and v
HOST_BYTES = 20  # host memory per offloaded parameter: the states, pinned staging, the gradient's fp32 copy
ACT_BYTES = 34  # activation bytes per layer x token x width (fused attention)


def shape_of(layers: int, tiny: bool) -> GPTShape:
    if tiny:
        return GPTShape(layers, TINY["dim"], TINY["heads"], TINY["vocab"], TINY["seq_len"])
    return GPTShape(layers, DIM, HEADS, VOCAB, SEQ)


def layers_for(params: float, tiny: bool) -> int:
    """The least depth whose model has at least ``params`` parameters."""
    base, one = shape_of(0, tiny).params(), shape_of(1, tiny).params() - shape_of(0, tiny).params()
    return max(1, math.ceil((params - base) / one))


def no_offload_depth(cap_bytes: float, batch: int) -> int:
    """The formula's deepest model that trains without offload in ``cap_bytes``: 16 bytes per parameter,
    the activations, the fp32 logits and their gradient, and 1.5 GiB of workspace."""
    s0, s1 = shape_of(0, False), shape_of(1, False)
    tokens = batch * SEQ
    fixed = STATE_BYTES * s0.params() + 12.0 * tokens * VOCAB + 1.5 * GiB
    per_layer = STATE_BYTES * (s1.params() - s0.params()) + ACT_BYTES * tokens * DIM
    return max(1, int((cap_bytes - fixed) // per_layer))


# -------------------------------------------------------------------------------------- CPU Adam case
def run_adam(case: dict[str, Any]) -> dict[str, Any]:
    import torch

    from deepshard.ops.adam import DeepSpeedCPUAdam

    torch.set_num_threads(os.cpu_count() or 1)
    n, chunk = int(case["params"]), 16 << 20
    sizes = [min(chunk, n - i) for i in range(0, n, chunk)]
    makers = {"torch AdamW (foreach)": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, foreach=True),
              "torch AdamW (fused)": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True),
              "deepshard DeepSpeedCPUAdam": lambda ps: DeepSpeedCPUAdam(ps, lr=1e-4, weight_decay=0.01)}
    rows = {}
    for name, make in makers.items():
        params = [torch.nn.Parameter(torch.randn(s)) for s in sizes]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = make(params)
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        step = statistics.median(times[1:])
        rows[name] = {"step_s": step, "params_per_s": n / step,
                      "state_GBps": n * 4 * 7 / step / 1e9}  # reads p, g, m, v; writes p, m, v (fp32)
        del opt, params
    return {"status": "ok", "params": n, "threads": torch.get_num_threads(), "rows": rows}


# -------------------------------------------------------------------------------------- training case
def ds_config(mode: str, batch: int, nvme_path: str) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3}
    if mode in ("cpu", "nvme"):
        where = {"device": mode, "pin_memory": True}
        if mode == "nvme":
            where["nvme_path"] = nvme_path
        zero["offload_param"] = dict(where)
        zero["offload_optimizer"] = dict(where)
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "fused": True}},
            "bf16": {"enabled": True}, "gradient_clipping": 0.0, "steps_per_print": 10**9,
            "zero_optimization": zero}


def _profile_step(engine: Any, x: Any, y: Any, device: str) -> dict[str, float]:
    """One more step, its forward + backward under torch.profiler: their wall time, and the GPU's kernel
    and copy time inside it; what forward + backward spent beyond its kernels is time the GPU waited
    (parameter fetches, gradient offload, host-side hooks). The optimizer step runs after, unprofiled."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        synchronize(device)
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        synchronize(device)
        fwd_bwd = time.perf_counter() - t0
    engine.step()
    compute = copy = 0.0
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(evt, "self_device_time_total", None)
        us = evt.self_cuda_time_total if us is None else us
        if evt.key.startswith(("Memcpy", "Memset")):
            copy += us / 1e6
        else:
            compute += us / 1e6
    if device != "cuda":
        compute = copy = None  # type: ignore[assignment]
    return {"profiled_fwd_bwd_s": fwd_bwd, "gpu_compute_s": compute, "gpu_copy_s": copy,
            "fwd_bwd_waiting_s": max(fwd_bwd - compute, 0.0) if device == "cuda" else None}


def run_train(case: dict[str, Any]) -> dict[str, Any]:
    import psutil
    import torch

    import deepshard
    from benchmarks.measure import PeakRSS

    device, mode = case["device"], case["mode"]
    if device == "cuda" and not torch.cuda.is_available():
        return {"status": "skipped", "detail": "no CUDA device"}
    torch.set_num_threads(os.cpu_count() or 1)
    if device == "cpu" and mode == "cpu":
        from deepshard.zero.offload.policy import FORCE_CPU_OFFLOAD_ENV

        os.environ[FORCE_CPU_OFFLOAD_ENV] = "1"  # the GPU's host-offload path, on the CPU (script check)
    init_single_process_group(device)
    if device == "cuda" and case.get("cap_gib"):
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, case["cap_gib"] * GiB / total))
    shape = shape_of(case["layers"], case.get("tiny", False))
    t0 = time.perf_counter()
    with deepshard.zero.Init(dtype=torch.bfloat16):
        model = shape.build(seed=0)
    engine, *_ = deepshard.initialize(model=model, config=ds_config(mode, case["batch"], case["nvme_path"]))
    setup_s = time.perf_counter() - t0
    profiled = case.get("profile", True)
    batches = gpt_batches(shape, case["batch"], case["steps"] + 1 + profiled, device)
    peak = PeakRSS()
    rows = []
    for i, (x, y) in enumerate(batches[:case["steps"] + 1]):
        if i == 1:
            peak.reset()
        synchronize(device)
        s0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        synchronize(device)
        s1 = time.perf_counter()
        engine.step()
        synchronize(device)
        rows.append({"step_s": time.perf_counter() - s0, "fwd_bwd_s": s1 - s0,
                     "optimizer_s": time.perf_counter() - s1, "loss": float(loss.detach())})
        print(f"[{case['name']}] step {i}: {rows[-1]['step_s']:.2f}s, loss {rows[-1]['loss']:.4f}", flush=True)
    prof = _profile_step(engine, *batches[-1], device) if profiled else \
        {"profiled_fwd_bwd_s": None, "gpu_compute_s": None, "gpu_copy_s": None, "fwd_bwd_waiting_s": None}
    timed = rows[1:] or rows
    step_s = statistics.median(r["step_s"] for r in timed)
    out = {"status": "ok", "mode": mode, "params": shape.params(), "layers": shape.layers, "setup_s": setup_s,
           "step_s": step_s, "fwd_bwd_s": statistics.median(r["fwd_bwd_s"] for r in timed),
           "optimizer_s": statistics.median(r["optimizer_s"] for r in timed),
           "tokens_per_s": case["batch"] * shape.seq_len / step_s, "losses": [r["loss"] for r in rows],
           "peak_host_rss_gib": peak.peak() / GiB, "host_memory_gib": psutil.virtual_memory().total / GiB,
           "memory_report": {k: v for k, v in engine.memory_report().items()}, **prof}
    if device == "cuda":
        out["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / GiB
    engine.destroy()
    return out


def run(case: dict[str, Any]) -> dict[str, Any]:
    return run_adam(case) if case["kind"] == "adam" else run_train(case)


# ------------------------------------------------------------------------------------------ driver
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--size", choices=["full", "tiny"], default="full", help="tiny: a few-thousand-parameter model")
    p.add_argument("--gpu-cap-gib", type=float, default=12.0, help="GPU memory the runs may use (0: all of it)")
    p.add_argument("--batch", type=int, default=1, help="micro-batch in sequences of 1024 tokens")
    p.add_argument("--steps", type=int, default=1, help="timed steps after one warm-up, then one profiled")
    p.add_argument("--adam-params", type=float, default=256e6)
    p.add_argument("--multiples", type=float, nargs="+", default=[3, 6, 10],
                   help="offloaded sizes to try, as multiples of the largest that trains without offload")
    p.add_argument("--nvme-multiple", type=float, default=0.0,
                   help="the size of the on-disk run, as a multiple of the largest without offload (0: the first "
                        "of --multiples); each step reads and writes every state on disk, so a smaller one is quicker")
    p.add_argument("--no-nvme", action="store_true", help="leave the on-disk run out")
    p.add_argument("--nvme-path", default="/tmp/deepshard-infinity")
    p.add_argument("--budget", type=float, default=210.0, help="seconds for the whole run; cases past it are skipped")
    p.add_argument("--out", default="")
    p.add_argument("--log-dir", default="/tmp/deepshard-gpu-bench/infinity")
    return p.parse_args(argv)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--case" in argv:
        return case_main(run, argv)
    stop_on_signals()
    args = parse_args(argv)
    report: dict[str, Any] = {"device": args.device, "gpu_cap_gib": args.gpu_cap_gib, "batch": args.batch}
    if args.device == "cuda" and not cuda_available():
        print("infinity_bench: no CUDA device here; nothing measured (use --device cpu --size tiny to check the script)")
        return _write(args, {**report, "status": "skipped", "detail": "no CUDA device"})
    budget, tiny = Budget(args.budget), args.size == "tiny"
    log = Path(args.log_dir)
    adam_n = 1e6 if tiny else args.adam_params
    report["adam"] = run_case(MODULE, {"name": "cpu-adam", "kind": "adam", "params": adam_n}, min(90, budget.left()), log)
    done: list[dict[str, Any]] = []
    base = {"kind": "train", "device": args.device, "batch": args.batch, "tiny": tiny, "nvme_path": args.nvme_path,
            "cap_gib": args.gpu_cap_gib}

    def train(name: str, mode: str, layers: int, steps: int, limit: float, profile: bool = True) -> dict[str, Any]:
        if budget.left() < 20:
            return {"name": name, "status": "skipped", "detail": "out of budget", "layers": layers}
        case = {**base, "name": name, "mode": mode, "layers": layers, "steps": steps, "profile": profile}
        result = run_case(MODULE, case, min(limit, budget.left()), log)
        result.setdefault("layers", layers)
        result.setdefault("params", shape_of(layers, tiny).params())
        done.append(result)
        _write(args, {**report, "status": "partial", "cases": done})  # a stopped run keeps what finished
        return result

    report["no_offload"] = search_no_offload(args, tiny, train)
    fits = [r for r in report["no_offload"] if r.get("status") == "ok"]
    n0 = max((r["params"] for r in fits), default=0)
    report["offload"] = offload_ladder(args, tiny, n0, train)
    report.update(headline(report, n0))
    _write(args, {**report, "status": "ok"})  # the figures first: a report that fails to print loses nothing
    print(summary_text(report), flush=True)
    return 0


def search_no_offload(args: argparse.Namespace, tiny: bool, train: Any) -> list[dict[str, Any]]:
    """Without offload: the formula's depth, then one deeper (expected out of memory) and shallower
    until one trains (at most 3 runs). On the CPU check, one small run."""
    if tiny or args.device == "cpu":
        return [train("no-offload-L2", "none", 2, args.steps, 120)]
    cap = (args.gpu_cap_gib or 0) * GiB or _gpu_total()
    guess = no_offload_depth(cap, args.batch)
    runs = [train(f"no-offload-L{guess}", "none", guess, 1, 60)]
    if runs[-1].get("status") == "ok":
        deeper = guess + max(1, guess // 4)
        runs.append(train(f"no-offload-L{deeper}", "none", deeper, 1, 60))
    else:
        shallower = max(1, int(guess * 0.75))
        runs.append(train(f"no-offload-L{shallower}", "none", shallower, 1, 60))
        if runs[-1].get("status") != "ok" and shallower > 1:
            runs.append(train(f"no-offload-L{max(1, shallower // 2)}", "none", max(1, shallower // 2), 1, 60))
    return runs


def offload_ladder(args: argparse.Namespace, tiny: bool, n0: int, train: Any) -> list[dict[str, Any]]:
    """The first multiple in host memory, then the same model in files (the requirement: both), then
    host memory at the larger multiples that fit (the headline), while the budget lasts."""
    if n0 == 0:
        return [{"name": "offload", "status": "skipped", "detail": "nothing trained without offload to compare with"}]
    import psutil

    host = psutil.virtual_memory().total
    runs: list[dict[str, Any]] = []
    for i, multiple in enumerate(args.multiples):
        layers = layers_for(multiple * n0, tiny)
        params = shape_of(layers, tiny).params()
        if HOST_BYTES * params > 0.85 * host:
            runs.append({"name": f"cpu-x{multiple:g}", "status": "skipped", "params": params, "layers": layers,
                         "detail": f"needs ~{HOST_BYTES * params / GiB:.0f} GiB of host memory of {host / GiB:.0f}"})
            break
        on_host = {**train(f"cpu-x{multiple:g}-L{layers}", "cpu", layers, args.steps, 150), "multiple": multiple}
        runs.append(on_host)
        if i == 0 and not args.no_nvme:
            nvme_layers = layers_for(args.nvme_multiple * n0, tiny) if args.nvme_multiple else layers
            runs.append(nvme_run(args, nvme_layers, tiny, train, n0))
        if on_host.get("status") != "ok":
            break
    return runs


def nvme_run(args: argparse.Namespace, layers: int, tiny: bool, train: Any, n0: int) -> dict[str, Any]:
    """On disk: ``layers`` deep, or as deep as half the free space allows; one warm-up and one timed
    step, no profiled one (each step reads and writes every state once)."""
    path = Path(args.nvme_path)
    path.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path).free
    while layers > 1 and STATE_BYTES * shape_of(layers, tiny).params() > free // 2:
        layers -= 1
    params = shape_of(layers, tiny).params()
    if STATE_BYTES * params > free // 2:
        return {"name": "nvme", "status": "skipped", "params": params, "layers": layers,
                "detail": f"needs ~{STATE_BYTES * params / GiB:.0f} GiB on disk, {free / GiB:.0f} GiB free"}
    try:
        result = train(f"nvme-L{layers}", "nvme", layers, 1, 100, profile=False)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return {**result, "multiple": params / n0, "disk_free_gib": free / GiB}


def headline(report: dict[str, Any], n0: int) -> dict[str, Any]:
    trained = [r for r in report["offload"] if r.get("status") == "ok"]
    best = max(trained, key=lambda r: r["params"], default=None)
    oom = [r for r in report["no_offload"] if r.get("status") == "oom"]
    return {"largest_without_offload": n0 or None,
            "smallest_oom_without_offload": min((r["params"] for r in oom), default=None),
            "largest_with_offload": best["params"] if best else None,
            "largest_with_offload_mode": best["mode"] if best else None,
            "ratio": best["params"] / n0 if best and n0 else None}


def summary_text(report: dict[str, Any]) -> str:
    lines = []
    adam = report.get("adam", {})
    for name, r in adam.get("rows", {}).items():
        lines.append(f"CPU Adam {name}: {r['params_per_s'] / 1e9:.2f}B params/s ({r['step_s'] * 1e3:.0f} ms per "
                     f"{adam['params'] / 1e6:.0f}M)")
    # a run stopped part-way has only the training cases it finished, in "cases"
    rows = (report.get("cases", []) if report.get("status") == "partial"
            else report.get("no_offload", []) + report.get("offload", []))
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"{r['name']}: {r.get('status')} {str(r.get('detail', ''))[:160]}")
            continue
        lines.append(f"{r['name']}: {_count(r['params'])} params, step {r['step_s']:.2f}s (fwd+bwd "
                     f"{r['fwd_bwd_s']:.2f}s, optimizer {r['optimizer_s']:.2f}s), {r['tokens_per_s']:.0f} tokens/s, "
                     f"GPU compute {_num(r['gpu_compute_s'])}s / copies {_num(r['gpu_copy_s'])}s / fwd+bwd waiting "
                     f"{_num(r['fwd_bwd_waiting_s'])}s, peak GPU {_num(r.get('peak_gpu_gib'), 1)} GiB, "
                     f"host {r['peak_host_rss_gib']:.1f} GiB")
    if report.get("ratio"):
        lines.append(f"headline: {_count(report['largest_with_offload'])} parameters trained with offload "
                     f"({report['largest_with_offload_mode']}) = {report['ratio']:.1f}x the largest without "
                     f"({_count(report['largest_without_offload'])}) under a {report['gpu_cap_gib']:g} GiB cap")
    return "\n".join(lines)


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _gpu_total() -> float:
    import torch

    return float(torch.cuda.get_device_properties(0).total_memory)


def _write(args: argparse.Namespace, report: dict[str, Any]) -> int:
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
