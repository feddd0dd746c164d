"""``deepshard dryrun --world_size N [--rank r] script.py [script args]``: one rank's view of an N-rank job."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None, prog: str = "deepshard dryrun") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=(
        "Run a training script unchanged as one rank of an N-rank job, in this one process, over torch's fake "
        "process group: the real grid, groups, ZeRO partitions, pipeline cut and offload decisions; collectives "
        "move no data. Prints that rank's model-state bytes, peak memory, collectives per step, process groups, "
        "init time and checkpoint files."))
    parser.add_argument("--world_size", type=int, required=True, help="ranks of the job to simulate")
    parser.add_argument("--rank", type=int, default=0, help="the rank whose view to take (default 0)")
    parser.add_argument("--steps", type=int, default=3,
                        help="stop the script after this many optimizer steps (0: run it to its end; default 3)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        parser.error(f"--rank {args.rank} must be in 0..{args.world_size - 1} for --world_size {args.world_size}")
    from deepshard.dryrun.report import format_report
    from deepshard.dryrun.runner import run_script

    report = run_script(args.script, args.script_args, args.world_size, args.rank, args.steps)
    print(format_report(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report.to_json(), f, indent=2)
    return 0
