"""DeepSpeed's CIFAR-10 tutorial with ``--moe``, unchanged, under deepshard and under real DeepSpeed on the
same synthetic data: per case, the loss curves and test accuracy side by side.

The cases are REFERENCE_MOE 8.1's (its flags, 400 steps of 8 samples per rank on 2 processes), plus ZeRO-3
runs that only deepshard builds (DeepSpeed refuses native MoE under ZeRO-3 at initialize). The runs go
through ``run_cifar.py`` (the stand-in ``torchvision``, one epoch of ``16 x steps`` images, every step's
loss printed by rank 0).

    python benchmarks/tutorials/run_moe_cifar.py /path/to/cifar10_deepspeed.py            # every case
    python benchmarks/tutorials/run_moe_cifar.py SCRIPT --cases e2_ep2_k1_z0 --steps 50 --library deepshard
    python benchmarks/tutorials/run_moe_cifar.py SCRIPT --cases e4_ep2_k2_pg_z1 --stages 0 1 2 3 --reuse old.json

Output: one line per run, then the table (per case: DeepSpeed's and deepshard's first-50 and last-50 mean
losses, how many leading steps print the same loss, the largest per-step difference, the difference of the
last-50 means, and both test accuracies). ``--json`` keeps every loss.

Reading it: both libraries draw the gate's random numbers in the same order and run the same layer
arithmetic, so the printed losses agree exactly until round-off from elsewhere (DeepSpeed's C++ Adam
against torch's, the order of a norm's sum) changes one token's routing; from then on the two runs are two
samples of one training process, and agree as DeepSpeed agrees with itself under another seed (REFERENCE_MOE
8.2): in 50-step means and accuracy, not step by step.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from benchmarks.tutorials.run_cifar import Run, add_run_arguments, check_run_arguments, run_one  # noqa: E402

CASES: dict[str, tuple[int, str, list[str]]] = {
    # name: (ZeRO stage, dtype, the tutorial's flags after --moe)
    "e2_ep1_k1_z0": (0, "fp32", ["--num-experts", "2", "--ep-world-size", "1", "--top-k", "1"]),
    "e2_ep2_k1_z0": (0, "fp32", ["--num-experts", "2", "--ep-world-size", "2", "--top-k", "1"]),
    "e2_ep1_k2_res_z0": (0, "fp32", ["--num-experts", "2", "--ep-world-size", "1", "--top-k", "2",
                                     "--mlp-type", "residual"]),
    "e4_ep2_k2_pg_z1": (1, "fp32", ["--num-experts", "4", "--ep-world-size", "2", "--top-k", "2", "--moe-param-group"]),
    "e4_ep2_k1_rs_pg_z2": (2, "fp32", ["--num-experts", "4", "--ep-world-size", "2", "--top-k", "1",
                                       "--noisy-gate-policy", "RSample", "--min-capacity", "2", "--moe-param-group"]),
    "e2e4_ep2_k2_jit_z2": (2, "fp32", ["--num-experts", "2", "4", "--ep-world-size", "2", "--top-k", "2",
                                       "--noisy-gate-policy", "Jitter"]),
    "e4_ep2_k3_z1": (1, "fp32", ["--num-experts", "4", "--ep-world-size", "2", "--top-k", "3"]),
    "e2_ep2_k2_pg_bf16_z2": (2, "bf16", ["--num-experts", "2", "--ep-world-size", "2", "--top-k", "2",
                                         "--moe-param-group"]),
    # beyond DeepSpeed: ZeRO-3 with expert parallelism (compared with DeepSpeed's ZeRO-2 run of the same flags)
    "e2_ep2_k1_z3": (3, "fp32", ["--num-experts", "2", "--ep-world-size", "2", "--top-k", "1"]),
    "e4_ep2_k2_pg_z3": (3, "fp32", ["--num-experts", "4", "--ep-world-size", "2", "--top-k", "2", "--moe-param-group"]),
}
DEEPSPEED_STAGE_FOR_ZERO3 = 2
"""DeepSpeed refuses ZeRO-3 with native MoE; its ZeRO-2 run (the same losses as its ZeRO 0 and 1: REFERENCE_MOE
8.2) is the comparison for deepshard's ZeRO-3 cases."""
ACCURACY = re.compile(r"Accuracy of the network on the \d+ test images:\s*(\d+)\s*%")


def accuracy(run: Run) -> Optional[int]:
    """The overall test accuracy the script printed (None: not printed)."""
    found = ACCURACY.findall(run.tail)
    return int(found[-1]) if found else None


def case_args(base: argparse.Namespace, stage: int, dtype: str, flags: list[str]) -> argparse.Namespace:
    """``run_cifar.run_one``'s arguments for one case."""
    args = argparse.Namespace(**vars(base))
    args.dtype, args.script_args = dtype, ["--moe", *flags]
    return args


def planned(cases: list[str], stages: Optional[list[int]]) -> list[tuple[str, str, int]]:
    """(row name, case, ZeRO stage) of every row: each case at its own stage, or at each of ``stages``
    (rows named ``<case>@z<stage>``)."""
    if not stages:
        return [(name, name, CASES[name][0]) for name in cases]
    return [(f"{name}@z{stage}", name, stage) for name in cases for stage in stages]


def run_case(base: argparse.Namespace, name: str, stage: int, workdir: Path,
             done: dict[tuple[str, str, int], Run]) -> dict[str, Run]:
    """Case ``name`` at ZeRO ``stage`` under each library (DeepSpeed at ZeRO 2 where ``stage`` is 3); a run
    already in ``done`` (the same library, flags and stage) is not repeated."""
    _, dtype, flags = CASES[name]
    runs = {}
    for library in base.libraries:
        lib_stage = DEEPSPEED_STAGE_FOR_ZERO3 if library == "deepspeed" and stage == 3 else stage
        key = (library, name, lib_stage)
        if key not in done:
            args = case_args(base, lib_stage, dtype, flags)
            if args.log_dir:
                args.log_dir = str(Path(args.log_dir) / name)
            run = run_one(args, library, lib_stage, workdir / name)
            print(f"{name} {run.label}: rc {run.returncode}, {len(run.losses)} losses, accuracy {accuracy(run)} %, "
                  f"{run.seconds:.1f} s", flush=True)
            if run.returncode != 0 or len(run.losses) != base.steps:
                print(run.tail, file=sys.stderr)
            done[key] = run
        runs[library] = done[key]
    return runs


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def row(name: str, runs: dict[str, Run], window: int = 50) -> dict[str, object]:
    """One line of the table (deepshard against DeepSpeed where both ran)."""
    ours, theirs = runs.get("deepshard"), runs.get("deepspeed")
    out: dict[str, object] = {"case": name}
    for label, run in (("deepspeed", theirs), ("deepshard", ours)):
        if run is not None:
            out[f"{label}_first"] = round(_mean(run.losses[:window]), 3)
            out[f"{label}_last"] = round(_mean(run.losses[-window:]), 3)
            out[f"{label}_acc"] = accuracy(run)
    if ours is not None and theirs is not None:
        pairs = list(zip(ours.losses, theirs.losses))
        out["same_steps"] = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
        out["max_step_diff"] = round(max((abs(a - b) for a, b in pairs), default=0.0), 3)
        out["last_mean_diff"] = round(abs(_mean(ours.losses[-window:]) - _mean(theirs.losses[-window:])), 3)
    return out


def table(rows: list[dict[str, object]]) -> str:
    head = (f"{'case':<22} {'DeepSpeed first->last':>22} {'deepshard first->last':>22} {'same steps':>10} "
            f"{'max |d| step':>12} {'|d| last50':>10} {'acc DS':>7} {'acc ours':>8}")
    lines = [head]
    for r in rows:
        def pair(label: str) -> str:
            return f"{r[label + '_first']:.3f} -> {r[label + '_last']:.3f}" if label + "_first" in r else "-"

        lines.append(f"{r['case']:<22} {pair('deepspeed'):>22} {pair('deepshard'):>22} {str(r.get('same_steps', '-')):>10} "
                     f"{str(r.get('max_step_diff', '-')):>12} {str(r.get('last_mean_diff', '-')):>10} "
                     f"{str(r.get('deepspeed_acc', '-')):>7} {str(r.get('deepshard_acc', '-')):>8}")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p)
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    p.add_argument("--stages", type=int, nargs="+", choices=[0, 1, 2, 3],
                   help="run every case at each of these ZeRO stages instead of its own")
    p.add_argument("--reuse", nargs="+", default=[], metavar="JSON",
                   help="take the runs (same library, case, stage and steps) from these earlier --json files")
    args = p.parse_args(argv)
    check_run_arguments(p, args)
    args.libraries = ["deepspeed", "deepshard"] if args.library == "both" else [args.library]
    return args


def reused(paths: list[str], args: argparse.Namespace) -> dict[tuple[str, str, int], Run]:
    """The runs of ``args.steps`` steps and ``args``' seeds that earlier ``--json`` files hold, by (library,
    case, stage): DeepSpeed's runs do not change with deepshard's code, and take twice as long as deepshard's."""
    done = {}
    for path in paths:
        for entry in json.loads(Path(path).read_text()).get("done", []):
            entry = dict(entry)
            case = entry.pop("case")
            run = Run(**entry)
            if case in CASES and run.returncode == 0 and len(run.losses) == args.steps and \
                    run.dtype == CASES[case][1] and (run.seed, run.torch_seed) == (args.seed, args.torch_seed):
                done[(run.library, case, run.stage)] = run
    return done


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    rows, everything = [], {}
    done = reused(args.reuse, args)
    with tempfile.TemporaryDirectory(prefix="moe-cifar-") as tmp:
        for row_name, name, stage in planned(args.cases, args.stages):
            runs = run_case(args, name, stage, Path(tmp), done)
            rows.append(row(row_name, runs))
            everything[row_name] = {library: asdict(run) for library, run in runs.items()}
    print(table(rows))
    if args.json:
        runs = [{"case": case, **asdict(run)} for (_, case, _), run in done.items()]
        Path(args.json).write_text(json.dumps({"table": rows, "runs": everything, "done": runs}, indent=1))
    ok = all(r.returncode == 0 and len(r.losses) == args.steps for runs in everything.values()
             for r in (Run(**v) for v in runs.values()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
