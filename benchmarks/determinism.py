"""Bitwise checks of deepshard's determinism (docs/determinism.md), on a small GPT, on the CPU.

    python benchmarks/determinism.py stages --world 2 --steps 1        # which parameters differ between stages
    python benchmarks/determinism.py layouts --steps 200               # dp x accumulation splits and a dp 2 -> 4 resume
    python benchmarks/determinism.py cost --world 4 --steps 20         # step time, default against deterministic

``stages``: ZeRO 0-3 at one data-parallel size, the same global batch: per stage pair, the parameters
whose fp32 values differ after ``--steps`` steps (and by how much). ``layouts``: with
``"deterministic": true``, at every stage (with and without optimizer offload), the global batch of 8
micro-batches as dp=1 x accumulation 8, 2 x 4, 4 x 2 and 8 x 1, and a run saved at dp=2 halfway and
resumed at dp=4: max |dtheta| against dp=1 x 8 at the same stage, and across stages. ``cost``: the
seconds per step with and without ``"deterministic"`` (repeats interleaved over stages and modes; medians,
the spread of the per-repeat ratios and the load average; on a shared machine the figures are only
indicative).

Every rank runs with one torch thread (CPU kernels give the same bits for the same shapes at one
thread count). Micro-batch ``a`` of a step is the same tensor in every layout; each rank trains the one
``engine.atom_index(micro_step)`` names.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

ATOMS = 8  # micro-batches per global batch
GPT = {"vocab": 64, "dim": 32, "layers": 2, "heads": 4, "seq_len": 16}


def build_model(seed: int = 0) -> torch.nn.Module:
    from benchmarks.workloads import TinyGPT

    torch.manual_seed(seed)
    return TinyGPT(GPT["vocab"], GPT["dim"], GPT["layers"], GPT["heads"], GPT["seq_len"])


def atom_batch(step: int, atom: int, micro: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``atom`` of global step ``step``: the same tensors whatever the layout."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + atom)
    vocab, seq = GPT["vocab"], GPT["seq_len"]
    start = torch.randint(0, vocab, (micro, 1), generator=gen)
    stride = torch.randint(1, 8, (micro, 1), generator=gen)
    noise = (torch.rand(micro, seq + 1, generator=gen) < 0.1).long() * torch.randint(0, vocab, (micro, seq + 1),
                                                                                       generator=gen)
    seqs = (start + stride * torch.arange(seq + 1) + noise) % vocab
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def make_config(stage: int, world: int, gas: int, micro: int, dtype: str, deterministic: bool, offload: bool,
                clip: float) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 4000, "stage3_param_persistence_threshold": 200}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_batch_size": micro * gas * world, "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas, "gradient_clipping": clip, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.99], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                     "warmup_num_steps": 20}},
        "zero_optimization": zero,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if deterministic:
        config["deterministic"] = True
    return config


def train_rank(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: train ``spec['steps']`` steps (from ``spec['first']``, after loading ``spec['load']``
    when given; saving to ``spec['save']`` at the end when given); rank 0 returns the losses it saw, the
    engine's gradient norms and every parameter's full fp32 value."""
    import deepshard
    from deepshard.utils import safe_get_full_fp32_param

    gas = int(spec.get("gas") or ATOMS // world)
    config = make_config(spec["stage"], world, gas, spec["micro"], spec["dtype"], spec["deterministic"],
                         spec["offload"], spec["clip"])
    engine, *_ = deepshard.initialize(model=build_model(), config=config)
    if spec.get("load"):
        engine.load_checkpoint(spec["load"])
    losses, norms, times, cpu = [], [], [], []
    first = int(spec.get("first", 0))
    for step in range(first, first + spec["steps"]):
        if step == first + 2:  # what ``cost`` counts: the steps after the first two
            engine.comms_logger.reset()
        start, cpu_start = time.perf_counter(), time.process_time()
        for m in range(gas):
            x, y = atom_batch(step, engine.atom_index(m), spec["micro"])
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach().float()))
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
        norms.append(engine.get_global_grad_norm())
    if spec.get("save"):
        engine.save_checkpoint(spec["save"])
    comm = engine.comms_logger.summary()
    params = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    engine.destroy()
    if rank != 0:
        return {"times": times}
    return {"losses": losses, "norms": norms, "params": {n: v.clone() for n, v in params.items()}, "times": times,
            "cpu": cpu, "comm": comm}


def run(world: int, spec: dict[str, Any], timeout: float = 3600.0) -> dict[str, Any]:
    from tests.multiproc.harness import run_world

    return run_world(train_rank, world, spec, timeout=timeout)[0]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in a)


def spec_of(args: argparse.Namespace, stage: int, **extra: Any) -> dict[str, Any]:
    spec = {"stage": stage, "micro": args.micro, "dtype": args.dtype, "deterministic": args.deterministic,
            "offload": False, "clip": args.clip, "steps": args.steps}
    spec.update(extra)
    return spec


# ------------------------------------------------------------------------------------------ commands
def cmd_stages(args: argparse.Namespace) -> dict[str, Any]:
    """Per stage pair: the parameters whose values differ (max |difference| each)."""
    results = {s: run(args.world, spec_of(args, s, gas=args.gas)) for s in args.stages}
    out: dict[str, Any] = {}
    for a, b in itertools.combinations(args.stages, 2):
        pa, pb = results[a]["params"], results[b]["params"]
        differing = {n: float((pa[n] - pb[n]).abs().max()) for n in pa if not torch.equal(pa[n], pb[n])}
        loss_equal = results[a]["losses"] == results[b]["losses"]
        norm_equal = results[a]["norms"] == results[b]["norms"]
        out[f"{a}-{b}"] = {"differing": differing, "losses_equal": loss_equal, "norms_equal": norm_equal}
        print(f"zero {a} vs zero {b}: {len(differing)}/{len(pa)} parameters differ"
              f"{' (max ' + format(max(differing.values()), '.3g') + ')' if differing else ''}; "
              f"losses {'equal' if loss_equal else 'differ'}, norms {'equal' if norm_equal else 'differ'}")
        for n, d in sorted(differing.items(), key=lambda kv: -kv[1])[:args.show]:
            print(f"    {n}: {d:.3g}")
    return out


def cmd_layouts(args: argparse.Namespace) -> dict[str, Any]:
    """dp x accumulation splits of one global batch, and a dp 2 -> 4 resume, per stage (and offload)."""
    out: dict[str, Any] = {}
    reference: Optional[dict[str, torch.Tensor]] = None
    for stage, offload in [(s, o) for s in args.stages for o in ((False, True) if args.offload and s else (False,))]:
        label = f"zero{stage}{'+offload' if offload else ''}"
        runs = {dp: run(dp, spec_of(args, stage, offload=offload)) for dp in args.dps}
        with tempfile.TemporaryDirectory(prefix="determinism-") as tmp:
            half = args.steps // 2
            run(2, spec_of(args, stage, offload=offload, steps=half, save=tmp))
            resumed = run(4, spec_of(args, stage, offload=offload, steps=args.steps - half, first=half, load=tmp))
        base = runs[args.dps[0]]["params"]
        row = {f"dp{dp}xgas{ATOMS // dp}": max_diff(base, r["params"]) for dp, r in runs.items()}
        row["resume dp2->dp4"] = max_diff(base, resumed["params"])
        if reference is None:
            reference = base
        row["vs first stage"] = max_diff(reference, base)
        out[label] = row
        print(label, json.dumps(row), flush=True)
    return out


def cmd_cost(args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per step (after the first two) at ``--world``, default against deterministic. The runs are
    interleaved: each repeat runs every stage in both modes, so load that comes and goes falls on all
    of them alike. Per stage: the median over every measured step of each mode, their ratio, and the
    spread of the per-repeat ratios (each repeat's median deterministic step over its median default
    step); the load average before and after."""
    samples: dict[tuple[int, bool], list[list[float]]] = {(s, d): [] for s in args.stages for d in (False, True)}
    cpu: dict[tuple[int, bool], list[float]] = {key: [] for key in samples}
    comm: dict[tuple[int, bool], dict[str, Any]] = {}
    load = [round(os.getloadavg()[0], 1)]
    for _ in range(args.repeats):
        for stage in args.stages:
            for det in (False, True):
                r = run(args.world, spec_of(args, stage, deterministic=det))
                samples[(stage, det)].append(r["times"][2:])
                cpu[(stage, det)].extend(r["cpu"][2:])
                counted = max(1, args.steps - 2)
                comm[(stage, det)] = {op: (v["calls"] / counted, v["bytes"] / counted) for op, v in r["comm"].items()}
        load.append(round(os.getloadavg()[0], 1))
    out: dict[str, Any] = {"load_average": load}
    for stage in args.stages:
        runs = {det: samples[(stage, det)] for det in (False, True)}
        med = {det: statistics.median([t for r in v for t in r]) for det, v in runs.items()}
        per_repeat = sorted(statistics.median(d) / statistics.median(b) for b, d in zip(runs[False], runs[True]))
        cpu_med = {det: statistics.median(cpu[(stage, det)]) for det in (False, True)}
        calls = {det: sum(c for c, _ in comm[(stage, det)].values()) for det in (False, True)}
        sent = {det: sum(b for _, b in comm[(stage, det)].values()) for det in (False, True)}
        out[f"zero{stage}"] = {"default_s": med[False], "deterministic_s": med[True], "ratio": med[True] / med[False],
                               "repeat_ratios": per_repeat, "cpu_default_s": cpu_med[False],
                               "cpu_deterministic_s": cpu_med[True], "collectives_per_step": calls,
                               "bytes_per_step": sent, "by_op": {str(det): comm[(stage, det)] for det in (False, True)}}
        print(f"zero{stage}: default {med[False] * 1e3:.1f} ms, deterministic {med[True] * 1e3:.1f} ms, "
              f"ratio {med[True] / med[False]:.2f} (per repeat {per_repeat[0]:.2f}-{per_repeat[-1]:.2f}); "
              f"rank 0 CPU {cpu_med[False] * 1e3:.1f} / {cpu_med[True] * 1e3:.1f} ms; collectives per step "
              f"{calls[False]:.1f} / {calls[True]:.1f}, MB {sent[False] / 1e6:.2f} / {sent[True] / 1e6:.2f}", flush=True)
    print(f"load average (1 min) before and after each repeat: {load}", flush=True)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["stages", "layouts", "cost"])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--dps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--gas", type=int, default=1, help="stages: accumulation steps")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--deterministic", action="store_true", help="stages: run with \"deterministic\": true")
    p.add_argument("--offload", action="store_true", help="layouts: also with offload_optimizer to the CPU")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--show", type=int, default=8, help="stages: parameters listed per pair")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.command == "layouts":
        args.deterministic = True
    result = {"stages": cmd_stages, "layouts": cmd_layouts, "cost": cmd_cost}[args.command](args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
