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
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
STANDIN = HERE / "standin"
GLOBAL_BATCH = 16  # the tutorial's train_batch_size
DEFAULT_DS_PYTHON = "/work/main/.venv-deepspeed/bin/python"
DEFAULT_EXTENSIONS = "~/.cache/deepshard/cifar-tutorial-torch-extensions"
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
        launcher = Path(ds_python).parent / "deepspeed"
        if not launcher.exists():
            raise SystemExit(f"no DeepSpeed launcher at {launcher}: pass --deepspeed-python PATH (the python of an "
                             "environment with deepspeed installed), or --library deepshard")
        port = _free_port()
        return [str(launcher), "--num_gpus", str(nprocs), "--master_port", str(port)]
    raise SystemExit(f"--library {library!r}: use deepshard, deepspeed or both")


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of every run: the stand-in torchvision first on the path, the data's size and seed,
    CPU accelerators, DeepSpeed's op builds in a folder of their own that outlives the run (building
    them takes minutes), one torch thread per process unless the caller set OMP_NUM_THREADS."""
    env = dict(os.environ)
    path = [str(STANDIN)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    threads = env.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // args.nprocs))
    env.update({
        "PYTHONPATH": os.pathsep.join(path),
        "CIFAR_STANDIN_TRAIN_SIZE": str(GLOBAL_BATCH * args.steps),
        "CIFAR_STANDIN_TEST_SIZE": str(args.test_size),
        "CIFAR_STANDIN_SEED": str(args.seed),
        "DS_ACCELERATOR": "cpu", "DEEPSHARD_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": str(Path(args.torch_extensions_dir).expanduser()),
        "OMP_NUM_THREADS": threads,
        "PYTHONWARNINGS": "ignore",
    })
    return env


def run_one(args: argparse.Namespace, library: str, stage: int, workdir: Path) -> Run:
    """Run the script once; the working directory is a fresh folder (the script names ``./data``)."""
    run = Run(library, stage, args.dtype)
    cwd = workdir / f"{library}-zero{stage}"
    cwd.mkdir(parents=True, exist_ok=True)
    cmd = library_command(library, args.nprocs, args.deepspeed_python) + [
        str(Path(args.script).resolve()), "--stage", str(stage), "--dtype", args.dtype, "--epochs", "1",
        "--log-interval", "1"] + list(args.script_args)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=run_env(args), capture_output=True, text=True,
                          timeout=args.timeout)
    run.seconds = time.perf_counter() - start
    run.returncode = proc.returncode
    run.losses = parse_losses(proc.stdout)
    run.tail = (proc.stdout + proc.stderr)[-3000:]
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.log_dir) / f"{library}-zero{stage}-{args.dtype}.log").write_text(proc.stdout + proc.stderr)
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
    p.add_argument("script", help="path of cifar10_deepspeed.py (DeepSpeedExamples/training/cifar)")
    p.add_argument("--library", choices=["deepshard", "deepspeed", "both"], default="both")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps (losses printed)")
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="data and initial weights (CIFAR_STANDIN_SEED)")
    p.add_argument("--test-size", type=int, default=400, help="test images the script evaluates at the end")
    p.add_argument("--deepspeed-python", default=os.environ.get("DEEPSHARD_DEEPSPEED_PYTHON", DEFAULT_DS_PYTHON))
    p.add_argument("--torch-extensions-dir", default=DEFAULT_EXTENSIONS,
                   help="where DeepSpeed builds its C++ ops (once: the first run takes minutes)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--json", help="write every run's losses here")
    p.add_argument("--log-dir", help="keep each run's full output here")
    args = p.parse_args(argv)
    args.script_args = script_args
    if args.steps <= 0 or args.test_size % 4:
        p.error("--steps must be > 0 and --test-size a multiple of 4 (the script tests in batches of 4)")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if not Path(args.script).is_file():
        raise SystemExit(f"{args.script}: no such file; pass the path of DeepSpeedExamples' "
                         "training/cifar/cifar10_deepspeed.py")
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
