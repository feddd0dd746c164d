"""``deepshard plan model.py --config ds.json --memory-per-rank X --world_size N``: the DeepSpeed config that fits."""
from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Sequence

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"40GiB"``, ``"1.5g"``, ``"800MB"`` or a plain byte count."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 40GiB, 800MB or 123456 (bytes)")
    return int(float(match.group(1)) * _UNITS[unit])


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main(argv: Sequence[str] | None = None, prog: str = "deepshard plan") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=(
        "Search ZeRO stage x offload x micro batch x activation checkpointing x tensor parallel x pipeline "
        "stages by dry runs (one rank of the job each, in this process) and write the DeepSpeed config that "
        "fits the memory per rank with the most headroom-adjusted throughput."))
    parser.add_argument("model", help="the model file (build_model, sample_batch; see deepshard.dryrun.plan_model)")
    parser.add_argument("--config", required=True, help="the DeepSpeed config to start from (its train_batch_size is kept)")
    parser.add_argument("--memory-per-rank", "--memory_per_rank", dest="memory", type=parse_bytes, required=True,
                        help="memory for tensors on each rank, e.g. 40GiB (what torch.cuda.max_memory_allocated "
                             "would read; on a CPU, live tensor bytes)")
    parser.add_argument("--world_size", type=int, required=True)
    parser.add_argument("--output", default="plan.json", help="where to write the chosen config (default plan.json)")
    parser.add_argument("--report", default=None, help="also write every trial to this JSON file")
    parser.add_argument("--bandwidth", type=float, default=10.0, help="GB/s per rank for collectives (default 10)")
    parser.add_argument("--stages", type=_ints, default=(0, 1, 2, 3))
    parser.add_argument("--micro", type=_ints, default=(1, 2, 4, 8, 16, 32), help="micro batch sizes to try")
    parser.add_argument("--tp", type=_ints, default=(1, 2, 4, 8))
    parser.add_argument("--pp", type=_ints, default=(1, 2, 4))
    parser.add_argument("--no_offload", action="store_true", help="do not try offloading")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    from deepshard.dryrun.plan_model import load_model_file
    from deepshard.dryrun.plan_space import OFFLOADS, Space
    from deepshard.dryrun.planner import format_plan, search, to_json

    with open(args.config, encoding="utf-8") as f:
        base = json.load(f)
    batch = base.get("train_batch_size")
    if not isinstance(batch, int) or batch < 1:
        parser.error(f"{args.config} needs train_batch_size (the global batch the plan keeps); found {batch!r}")
    space = Space(args.world_size, batch, stages=args.stages, micros=args.micro, tps=args.tp, pps=args.pp,
                  offloads=("none",) if args.no_offload else OFFLOADS)
    plan = search(load_model_file(args.model), base, space, args.memory, args.bandwidth * 1e9,
                  progress=lambda t: print(f"  tried {t.choice.label()}: "
                                           + (t.reason or f"peak {t.peak_bytes / 2**20:,.1f} MiB"), flush=True))
    print(format_plan(plan))
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(to_json(plan), f, indent=2)
    if plan.config is None:
        return 1
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(plan.config, f, indent=2)
    print(f"wrote {args.output}")
    return 0
