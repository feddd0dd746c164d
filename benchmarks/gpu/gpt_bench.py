"""GPT-style training in bf16 on one GPU: deepshard ZeRO stages 0 and 3 against plain torch and FSDP2
(and DeepSpeed when it imports), at world size 1. Tokens/s and MFU per engine.

    python -m benchmarks.gpu.gpt_bench --out gpt.json                # on a GPU machine
    python -m benchmarks.gpu.gpt_bench --device cpu --size tiny      # checks the script on a CPU

Every engine runs in a fresh process, starts from the same weights (fp32, one seed, built on the
device), sees the same batches and trains with AdamW (lr 1e-4, weight decay 0.01, no clipping):

- ``torch``: fp32 parameters, ``torch.autocast(bfloat16)``, ``AdamW(fused=True)``;
- ``fsdp2``: ``fully_shard`` per block and on the root, ``MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32)``, ``AdamW(foreach=True)`` (torch's default for its DTensor parameters);
- ``deepshard-z0`` / ``-z3``: the ``bf16`` section (bf16 module, fp32 master weights), the config's
  ``AdamW`` with ``fused: true``;
- ``deepspeed-z0`` / ``-z3``: the same config with a client ``torch.optim.AdamW(fused=True)``, where
  ``import deepspeed`` works (``DEEPSPEED_SITE`` names a folder to import it from).

Step time: the median of the timed steps (after warm-up), each ended by reading the loss (a device
synchronization). MFU: FLOPs per token (``GPTShape.flops_per_token``) x tokens/s / the datasheet's dense
bf16 rate; also given against the bf16 matrix-product rate measured on the card first.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.common import (GiB, GPTShape, as_dict, case_main, cuda_available, gpt_batches,  # noqa: E402
                                   init_single_process_group, peak_device_memory, run_case,
                                   stop_on_signals)

ENGINES = ("torch", "deepshard-z0", "deepshard-z3", "fsdp2", "deepspeed-z0", "deepspeed-z3")
LR, WEIGHT_DECAY = 1e-4, 0.01
TINY = GPTShape(layers=2, dim=64, heads=2, vocab=256, seq_len=32)
# largest first; (shape, micro-batches to try)
LADDER = [GPTShape(32, 4096, 32, 50304, 2048), GPTShape(32, 2560, 20, 50304, 2048),
          GPTShape(24, 2048, 16, 50304, 2048), GPTShape(12, 1024, 16, 50304, 2048)]
BYTES_PER_PARAM = 20  # 16 for bf16 + fp32 master + Adam, 4 more for copies an engine keeps (sized to fit all)
MEMORY_SHARE = 0.7


def estimate_bytes(shape: GPTShape, batch: int) -> float:
    """Model states, activations (34 bytes per layer x token x width with fused attention) and logits."""
    tokens = batch * shape.seq_len
    return (BYTES_PER_PARAM * shape.params() + 34.0 * shape.layers * tokens * shape.dim
            + 10.0 * tokens * shape.vocab)


def pick_size(memory_bytes: float) -> tuple[GPTShape, int]:
    """The largest ladder shape (and micro-batch of 8, 4 or 2) whose estimate fits MEMORY_SHARE of the card."""
    for shape in LADDER:
        for batch in (8, 4, 2):
            if estimate_bytes(shape, batch) <= MEMORY_SHARE * memory_bytes:
                return shape, batch
    return LADDER[-1], 1


# ------------------------------------------------------------------------------------------ engines
def _adamw(params: Any, device: str) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=device == "cuda")


def setup_torch(model: Any, device: str, case: dict[str, Any]) -> Callable[[Any, Any], Any]:
    import torch

    opt = _adamw(model.parameters(), device)

    def step(x: Any, y: Any) -> Any:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        return loss
    return step


def setup_fsdp2(model: Any, device: str, case: dict[str, Any]) -> Callable[[Any, Any], Any]:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)

    def step(x: Any, y: Any) -> Any:
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        return loss
    return step


def engine_config(stage: int, batch: int, device: str, optimizer: bool = True) -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
                           "bf16": {"enabled": True}, "gradient_clipping": 0.0, "steps_per_print": 10**9,
                           "zero_optimization": {"stage": stage}}
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY,
                                                        "fused": device == "cuda"}}
    return cfg


def _engine_step(engine: Any) -> Callable[[Any, Any], Any]:
    def step(x: Any, y: Any) -> Any:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss
    return step


def setup_deepshard(model: Any, device: str, case: dict[str, Any]) -> Callable[[Any, Any], Any]:
    import deepshard

    stage = int(case["engine"].rsplit("z", 1)[1])
    engine, *_ = deepshard.initialize(model=model, config=engine_config(stage, case["batch"], device))
    return _engine_step(engine)


def setup_deepspeed(model: Any, device: str, case: dict[str, Any]) -> Callable[[Any, Any], Any]:
    site = os.environ.get("DEEPSPEED_SITE")
    if site:
        sys.path.insert(0, site)
    os.environ["DS_ACCELERATOR"] = device
    try:
        import deepspeed
    except ImportError as exc:
        raise _Skip(f"deepspeed does not import here ({exc}); carry its wheel (benchmarks/gpu/fetch_wheels.sh)")
    stage = int(case["engine"].rsplit("z", 1)[1])
    cfg = {**engine_config(stage, case["batch"], device, optimizer=False), "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=_adamw(model.parameters(), device), config=cfg)
    return _engine_step(engine)


class _Skip(Exception):
    """The engine cannot run here (not installed); reported as skipped."""


SETUPS = {"torch": setup_torch, "fsdp2": setup_fsdp2, "deepshard": setup_deepshard, "deepspeed": setup_deepspeed}


# ---------------------------------------------------------------------------------------- one case
def run_engine(case: dict[str, Any]) -> dict[str, Any]:
    """Build, set up, train ``warmup + steps`` steps and time them (runs in its own process)."""
    import torch

    device = case["device"]
    if device == "cuda" and not torch.cuda.is_available():
        return {"status": "skipped", "detail": "no CUDA device"}
    torch.set_num_threads(os.cpu_count() or 1)
    init_single_process_group(device)
    shape = GPTShape(**{k: case["shape"][k] for k in ("layers", "dim", "heads", "vocab", "seq_len")})
    with torch.device(device):
        model = shape.build(seed=0)
    try:
        step = SETUPS[case["engine"].split("-")[0]](model, device, case)
    except _Skip as why:
        return {"status": "skipped", "detail": str(why)}
    batches = gpt_batches(shape, case["batch"], case["warmup"] + case["steps"], device)
    times, losses = [], []
    for x, y in batches:
        t0 = time.perf_counter()
        loss = float(step(x, y).detach())  # reading the loss waits for the device
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    timed = times[case["warmup"]:]
    step_s = statistics.median(timed)
    tokens_per_s = case["batch"] * shape.seq_len / step_s
    out: dict[str, Any] = {"status": "ok", "step_ms": step_s * 1e3, "step_ms_all": [t * 1e3 for t in times],
                           "tokens_per_s": tokens_per_s, "losses": losses,
                           "achieved_flops": shape.flops_per_token() * tokens_per_s}
    mem = peak_device_memory(device)
    if mem is not None:
        out["peak_memory_gib"] = mem / GiB
    if case.get("profile"):  # after the timed steps, so the profiler costs them nothing
        from benchmarks.gpu.profile_steps import profile_steps

        more = gpt_batches(shape, case["batch"], case["profile"], device, seed=1)
        out["profile"] = profile_steps(step, more, Path(case["profile_path"]), device)
    return out


# ------------------------------------------------------------------------------------------ driver
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--size", default="auto",
                   help="auto (the largest ladder shape that fits the card), tiny, or LAYERSxWIDTH (e.g. 24x2048)")
    p.add_argument("--batch", type=int, default=0, help="micro-batch (sequences); 0: with --size auto, picked")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--case-timeout", type=float, default=120.0, help="seconds per engine before it is killed")
    p.add_argument("--budget", type=float, default=900.0, help="seconds for all engines; the rest are skipped")
    p.add_argument("--device-json", default="", help="benchmarks.gpu.probe's output: peak, measured rate, memory")
    p.add_argument("--peak-flops", type=float, default=0.0, help="the card's dense bf16 FLOP/s (default: datasheet)")
    p.add_argument("--measured-flops", type=float, default=0.0, help="the measured bf16 matmul FLOP/s, if known")
    p.add_argument("--memory-gib", type=float, default=0.0, help="the card's memory (default: read from torch)")
    p.add_argument("--profile", type=int, default=0,
                   help="after the timed steps, profile this many more (benchmarks.gpu.profile_steps): device "
                        "busy and idle time, copies, synchronizations; tables in --log-dir/<engine>.profile.txt")
    p.add_argument("--out", default="", help="write every figure as JSON here")
    p.add_argument("--log-dir", default="/tmp/deepshard-gpu-bench/gpt")
    return p.parse_args(argv)


def choose_shape(args: argparse.Namespace) -> tuple[GPTShape, int]:
    if args.size == "tiny":
        return TINY, args.batch or 2
    if args.size != "auto":
        layers, dim = (int(v) for v in args.size.lower().split("x"))
        return GPTShape(layers, dim, max(1, dim // 128), 50304, 2048), args.batch or 4
    shape, batch = pick_size(args.memory_gib * GiB)
    return shape, args.batch or batch


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--case" in argv:
        return case_main(run_engine, argv)
    stop_on_signals()
    args = parse_args(argv)
    if args.device == "cuda" and not cuda_available():
        print("gpt_bench: no CUDA device here; nothing measured (use --device cpu --size tiny to check the script)")
        _write(args, {"status": "skipped", "detail": "no CUDA device"})
        return 0
    if args.device_json and Path(args.device_json).exists():
        probe = json.loads(Path(args.device_json).read_text())
        args.peak_flops = args.peak_flops or probe.get("peak_bf16_flops_datasheet") or 0.0
        args.measured_flops = args.measured_flops or probe.get("measured_matmul_flops") or 0.0
        args.memory_gib = args.memory_gib or probe.get("memory_gib") or 0.0
    if args.size == "auto" and not args.memory_gib:
        import torch

        args.memory_gib = torch.cuda.get_device_properties(0).total_memory / GiB if args.device == "cuda" else 8.0
    shape, batch = choose_shape(args)
    print(f"gpt_bench: {shape.describe()}, micro-batch {batch} ({batch * shape.seq_len} tokens/step), "
          f"estimate {estimate_bytes(shape, batch) / GiB:.1f} GiB", flush=True)
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + args.budget
    for engine in args.engines:
        left = deadline - time.monotonic()
        if left < 15:
            rows.append({"name": engine, "status": "skipped", "detail": f"out of budget ({args.budget:.0f}s)"})
            continue
        case = {"name": engine, "engine": engine, "device": args.device, "shape": as_dict(shape), "batch": batch,
                "warmup": args.warmup, "steps": args.steps, "profile": args.profile,
                "profile_path": str(Path(args.log_dir) / f"{engine}.profile.txt")}
        rows.append(run_case("benchmarks.gpu.gpt_bench", case, min(args.case_timeout, left), Path(args.log_dir)))
        _write(args, summarize(rows, shape, batch, args))  # after every engine: a stopped run keeps its rows
    report = summarize(rows, shape, batch, args)
    print(table(report), flush=True)
    return 0


def summarize(rows: list[dict[str, Any]], shape: GPTShape, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """MFU per row (datasheet and measured rates) and each row's tokens/s against plain torch's."""
    base = next((r for r in rows if r["name"] == "torch" and r.get("status") == "ok"), None)
    for r in rows:
        if r.get("status") != "ok":
            continue
        if args.peak_flops:
            r["mfu"] = r["achieved_flops"] / args.peak_flops
        if args.measured_flops:
            r["mfu_vs_measured_matmul"] = r["achieved_flops"] / args.measured_flops
        if base is not None:
            r["x_torch_tokens_per_s"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["final_loss_vs_torch"] = r["losses"][-1] / base["losses"][-1]
    return {"status": "ok", "shape": as_dict(shape), "micro_batch": batch, "tokens_per_step": batch * shape.seq_len,
            "warmup": args.warmup, "steps": args.steps, "device": args.device, "peak_flops": args.peak_flops or None,
            "measured_matmul_flops": args.measured_flops or None, "rows": rows}


def table(report: dict[str, Any]) -> str:
    lines = ["| engine | status | step ms | tokens/s | MFU | MFU (measured matmul) | x torch | peak GiB | final loss |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['name']} | {r.get('status')}: {str(r.get('detail', ''))[:80]} | | | | | | | |")
            continue
        pct = (lambda k: f"{100 * r[k]:.1f}%" if k in r else "-")
        lines.append(f"| {r['name']} | ok | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {pct('mfu')} | "
                     f"{pct('mfu_vs_measured_matmul')} | {r.get('x_torch_tokens_per_s', float('nan')):.3f} | "
                     f"{r.get('peak_memory_gib', float('nan')):.1f} | {r['losses'][-1]:.4f} |")
    profiled = [r for r in report["rows"] if r.get("status") == "ok" and r.get("profile")]
    if profiled:
        lines += ["", "| engine (profiled) | wall ms | device busy ms | device idle | kernels | copies | copy ms | "
                      "host syncs |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in profiled:
            p = r["profile"]
            idle = f"{100 * p['device_idle_share']:.1f}%" if p.get("device_idle_share") is not None else "-"
            lines.append(f"| {r['name']} | {p['wall_ms']:.1f} | {p['device_busy_ms']:.1f} | {idle} | "
                         f"{p['kernels']:.0f} | {p['memcpy']:.0f} | {p['memcpy_ms']:.2f} | {p['syncs']:.0f} |")
    return "\n".join(lines)


def _write(args: argparse.Namespace, report: dict[str, Any]) -> None:
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
