"""Run DeepSpeed's CIFAR-10 tutorial script, unchanged, under deepshard and under real DeepSpeed, and
compare the losses it prints.

The script (``training/cifar/cifar10_deepspeed.py`` of DeepSpeedExamples) is not part of this
repository: pass its path. It imports ``torchvision`` for its data; the stand-in package under
``benchmarks/tutorials/standin`` answers that offline with a synthetic, learnable, fixed data set and
seeds torch's generator so every run starts from the same weights (see its docstring).

Each run is ``deepshard --num_gpus N script ...`` (deepshard answers the script's ``import deepspeed``)
or ``deepspeed --num_gpus N script ...`` from DeepSpeed's own environment with ``DS_ACCELERATOR=cpu``.
The data set holds ``16 x steps`` images and the script runs one epoch with ``--log-interval 1``, so
it prints rank 0's loss after every one of ``steps`` optimizer steps (to the 3 decimals it prints).

    python benchmarks/tutorials/run_cifar.py /path/to/cifar10_deepspeed.py --stages 0 1 2 3 --steps 400
    python benchmarks/tutorials/run_cifar.py SCRIPT --library deepspeed --stages 0 3 -- --moe --num-experts 2

Arguments after ``--`` go to the script. Output: one line per run, then the largest loss difference
of every run against the first and the first step at which they differ; ``--json`` writes every loss.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.deepspeed_launch import (DEFAULT_DS_PYTHON, DEFAULT_EXTENSIONS, deepspeed_env, free_port,  # noqa: E402
                                         require_launcher, start, wait_all)

STANDIN = HERE / "standin"
GLOBAL_BATCH = 16  # the tutorial's train_batch_size
LOSS_LINE = re.compile(r"^\[\s*(\d+),\s*(\d+)\] loss:\s*(\S+)\s*$")


@dataclass
class Run:
    """One run of the script and what it printed."""

    library: str
    stage: int
    dtype: str
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    returncode: int = 0
    tail: str = ""
    seed: int = 0
    torch_seed: Optional[int] = None

    @property
    def label(self) -> str:
        return f"{self.library} zero{self.stage} {self.dtype}"


def parse_losses(output: str) -> list[float]:
    """The values of the script's ``[epoch, step] loss: x`` lines, in order."""
    losses = []
    for line in output.splitlines():
        m = LOSS_LINE.match(line.strip())
        if m:
            losses.append(float(m.group(3)))
    return losses


def library_command(library: str, nprocs: int, ds_python: str) -> list[str]:
    """The launcher command line of ``library`` (without the script)."""
    if library == "deepshard":
        return [sys.executable, "-m", "deepshard.launcher", "--num_gpus", str(nprocs), "--master_port", "0"]
    if library == "deepspeed":
        launcher = require_launcher(ds_python, "deepspeed")
        return [str(launcher), "--num_gpus", str(nprocs), "--master_port", str(free_port())]
    raise SystemExit(f"--library {library!r}: use deepshard, deepspeed or both")


def run_env(args: argparse.Namespace, library: str) -> dict[str, str]:
    """The environment of a run: the stand-in torchvision first on the path, the data's size and seed,
    CPU accelerators, one torch thread per process unless the caller set OMP_NUM_THREADS; DeepSpeed's op
    builds in a folder of their own that outlives the run (the tutorial's Adam is DeepSpeed's C++ one: the
    first run builds it, minutes)."""
    env = dict(os.environ)
    path = [str(STANDIN)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    threads = env.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // args.nprocs))
    env.update({
        "PYTHONPATH": os.pathsep.join(path),
        "CIFAR_STANDIN_TRAIN_SIZE": str(GLOBAL_BATCH * args.steps),
        "CIFAR_STANDIN_TEST_SIZE": str(args.test_size),
        "CIFAR_STANDIN_SEED": str(args.seed),
        **({"CIFAR_STANDIN_TORCH_SEED": str(args.torch_seed)} if args.torch_seed is not None else {}),
        "DS_ACCELERATOR": "cpu", "DEEPSHARD_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": threads,
        "PYTHONWARNINGS": "ignore",
    })
    return deepspeed_env(env, args.torch_extensions_dir, no_builds=False) if library == "deepspeed" else env


def run_one(args: argparse.Namespace, library: str, stage: int, workdir: Path) -> Run:
    """Run the script once; the working directory is a fresh folder (the script names ``./data``)."""
    run = Run(library, stage, args.dtype, seed=args.seed, torch_seed=args.torch_seed)
    cwd = workdir / f"{library}-zero{stage}"
    cwd.mkdir(parents=True, exist_ok=True)
    cmd = library_command(library, args.nprocs, args.deepspeed_python) + [
        str(Path(args.script).resolve()), "--stage", str(stage), "--dtype", args.dtype, "--epochs", "1",
        "--log-interval", "1"] + list(args.script_args)
    began = time.perf_counter()
    with open(cwd / "output.log", "w") as log:
        failure = wait_all([start(cmd, run_env(args, library), log, cwd)], args.timeout)
    output = (cwd / "output.log").read_text()
    run.seconds = time.perf_counter() - began
    run.returncode = 0 if failure is None else 1
    run.losses = parse_losses(output)
    run.tail = output[-3000:] + ("" if failure is None else f"\n[run_cifar] {failure}")
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.log_dir) / f"{library}-zero{stage}-{args.dtype}.log").write_text(output)
    return run


def compare(base: Run, other: Run) -> tuple[float, Optional[int]]:
    """The largest |loss difference| over the steps both printed, and the first step (1-based) at which
    the printed losses differ (None: identical)."""
    pairs = list(zip(base.losses, other.losses))
    worst = max((abs(a - b) for a, b in pairs), default=0.0)
    first = next((i + 1 for i, (a, b) in enumerate(pairs) if a != b), None)
    return worst, first


def report(runs: list[Run]) -> str:
    lines = [f"{'run':<24} {'rc':>3} {'steps':>6} {'seconds':>8}  {'max|dloss| vs first':>20}  first differing step"]
    base = runs[0]
    for r in runs:
        worst, first = compare(base, r)
        lines.append(f"{r.label:<24} {r.returncode:>3} {len(r.losses):>6} {r.seconds:>8.1f}  {worst:>20.3f}  "
                     f"{'-' if first is None else first}")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p)
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    args = p.parse_args(argv)
    args.script_args = script_args
    check_run_arguments(p, args)
    return args


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of a run that run_cifar.py and run_moe_cifar.py share."""
    p.add_argument("script", help="path of cifar10_deepspeed.py (DeepSpeedExamples/training/cifar)")
    p.add_argument("--library", choices=["deepshard", "deepspeed", "both"], default="both")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps (losses printed)")
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="data and initial weights (CIFAR_STANDIN_SEED)")
    p.add_argument("--torch-seed", type=int, default=None,
                   help="torch's generator alone (initial weights, shuffle, the gate's draws), the data kept: "
                        "CIFAR_STANDIN_TORCH_SEED (default: --seed)")
    p.add_argument("--test-size", type=int, default=400, help="test images the script evaluates at the end")
    p.add_argument("--deepspeed-python", default=DEFAULT_DS_PYTHON)
    p.add_argument("--torch-extensions-dir", default=DEFAULT_EXTENSIONS,
                   help="where DeepSpeed builds its C++ ops (once: the first run takes minutes)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run (then it is killed)")
    p.add_argument("--json", help="write every run's losses here")
    p.add_argument("--log-dir", help="keep each run's full output here")


def check_run_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what the tutorial cannot run, and a script path that is not a file."""
    if args.steps <= 0 or args.test_size % 4:
        p.error("--steps must be > 0 and --test-size a multiple of 4 (the script tests in batches of 4)")
    if not Path(args.script).is_file():
        p.error(f"{args.script}: no such file; pass the path of DeepSpeedExamples' training/cifar/cifar10_deepspeed.py")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    libraries = ["deepshard", "deepspeed"] if args.library == "both" else [args.library]
    runs = []
    with tempfile.TemporaryDirectory(prefix="cifar-tutorial-") as tmp:
        for library in libraries:
            for stage in args.stages:
                run = run_one(args, library, stage, Path(tmp))
                print(f"{run.label}: rc {run.returncode}, {len(run.losses)} losses, {run.seconds:.1f} s", flush=True)
                if run.returncode != 0 or len(run.losses) != args.steps:
                    print(run.tail, file=sys.stderr)
                runs.append(run)
    print(report(runs))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in runs], indent=1))
    return 0 if all(r.returncode == 0 and len(r.losses) == args.steps for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
