"""Run DeepSpeed's own unit tests, unmodified, on real DeepSpeed and on deepshard, and record per test id
what happened (the judge of deepshard's DeepSpeed compatibility; docs/compatibility.md is made from it).

Why a tool here and not a test in ``tests/``: DeepSpeed's tests are not ours to commit and CI cannot fetch
them (no GitHub there; the PyPI sdist has no tests), so this runs on a developer's machine against a
DeepSpeed checkout given on the command line, and what it finds is committed as data
(``tools/ds_unit_tests/results.json``) and as the generated table. Nothing in the checkout is edited:
its ``tests/`` folder is copied to a scratch folder, and each side is told apart only by the environment:

* ``deepspeed``: DeepSpeed's venv (``--ds-python``), ``DS_ACCELERATOR=cpu``;
* ``deepshard``: this checkout's venv with ``tools/ds_unit_tests/shim`` on ``PYTHONPATH``, whose
  ``sitecustomize`` calls ``deepshard.compat.install()`` in every process (DeepSpeed's DistributedTest
  spawns its workers through a forkserver, which a pytest plugin would not reach).

Both sides run with ``LOCAL_SIZE`` set (default 2): DeepSpeed's CPU accelerator, and deepshard's, count
that many devices, so the tests DeepSpeed runs at world size 1 and 2 run and the larger ones skip. Each
file runs under ``timeout``; a file cut short keeps the results of the tests that finished.

    python tools/ds_unit_tests/runner.py --checkout /path/to/DeepSpeed --side both
    python tools/ds_unit_tests/runner.py --checkout ... --side deepshard --files runtime/test_ds_config_model.py
    python tools/ds_unit_tests/report.py      # docs/compatibility.md from results.json
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SHIM = HERE / "shim"
DEFAULT_RESULTS = HERE / "results.json"
SIDES = ("deepspeed", "deepshard")


def default_globs() -> list[str]:
    """The file globs of ``files.txt`` (comments and blank lines dropped)."""
    lines = (HERE / "files.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def expand(unit_dir: Path, patterns: list[str]) -> list[str]:
    """Test files under ``unit_dir`` matching ``patterns``, as paths relative to it, in a stable order."""
    found: list[str] = []
    for pattern in patterns:
        matches = sorted(p.relative_to(unit_dir).as_posix() for p in unit_dir.glob(pattern) if p.is_file())
        if not matches:
            raise SystemExit(f"no DeepSpeed test file matches {pattern!r} under {unit_dir}; check --checkout "
                             "(the DeepSpeed repository root, holding tests/unit)")
        found += [m for m in matches if m not in found]
    return found


def side_env(side: str, local_size: int, extra_path: str, per_test_timeout: int,
             preload: bool = True) -> dict[str, str]:
    """The environment one side's pytest runs under."""
    env = dict(os.environ)
    for name in ("DEEPSHARD_DS_UNIT_SHIM", "PYTHONPATH", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(name, None)
    paths = [str(SHIM)] + ([extra_path] if extra_path else [])
    env.update(PYTHONPATH=os.pathsep.join(paths), DS_ACCELERATOR="cpu", LOCAL_SIZE=str(local_size),
               DS_UNITTEST_TIMEOUT=str(per_test_timeout), PYTHONDONTWRITEBYTECODE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    if side == "deepshard":
        env["DEEPSHARD_DS_UNIT_SHIM"] = "1"
    if preload:  # torch only: forking after deepspeed's import (which starts threads) deadlocks workers
        env["DS_UNIT_FORKSERVER_PRELOAD"] = "torch"
    return env


def run_file(python: str, tests_dir: Path, rel: str, env: dict[str, str], timeout: int,
             keyword: str = "") -> dict[str, Any]:
    """One DeepSpeed test file under pytest (only the tests ``keyword`` selects, as pytest's ``-k``, where
    given): per test id outcome, why, world sizes; plus the exit code."""
    with tempfile.TemporaryDirectory() as scratch:
        results = Path(scratch) / "results.json"
        cmd = ["timeout", "--kill-after=20", str(timeout), python, "-m", "pytest", "-p", "no:cacheprovider",
               "-p", "ds_unit_record", "-q", "-rN", "--color=no", "--basetemp", str(Path(scratch) / "tmp"),
               f"unit/{rel}"] + (["-k", keyword] if keyword else [])
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=tests_dir, env={**env, "DS_UNIT_RESULTS": str(results)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        seconds = round(time.monotonic() - start, 1)
        data = json.loads(results.read_text()) if results.exists() else {"tests": {}, "collect_errors": []}
    tail = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    timed_out = proc.returncode in (124, 137)
    if not data["tests"] and not data["collect_errors"] and proc.returncode not in (0, 5):
        data["collect_errors"].append(f"pytest exited {proc.returncode}: {' '.join(tail)}")
    return {"rc": proc.returncode, "timed_out": timed_out, "seconds": seconds, "tests": data["tests"],
            "collect_errors": data["collect_errors"]}


def _venv_python(python: str) -> str:
    """``python`` with the folders above it resolved (a symlinked venv folder becomes its real path, so
    torch's JIT builds of DeepSpeed's ops are found under the paths they were built with) but the
    interpreter link itself kept (resolving it would leave the venv)."""
    path = Path(python)
    return str(path.parent.resolve() / path.name) if path.parent.exists() else python


def load_results(path: Path) -> dict[str, Any]:
    if path.exists():
        return json.loads(path.read_text())
    return {"meta": {}, "files": {}}


def _checkout_commit(checkout: Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", required=True, type=Path, help="DeepSpeed repository root (has tests/unit)")
    parser.add_argument("--side", choices=(*SIDES, "both"), default="both")
    parser.add_argument("--files", nargs="*", help="globs under tests/unit (default: tools/ds_unit_tests/files.txt)")
    parser.add_argument("--exclude", nargs="*", default=[], help="globs of files to leave out")
    parser.add_argument("-k", dest="keyword", default="",
                        help="pytest -k expression: run only the tests it selects and merge their outcomes "
                             "into the file's earlier results (to re-run a few tests of a long file)")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="JSON updated in place")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per file and side")
    parser.add_argument("--local-size", type=int, default=2, help="devices the CPU accelerators count")
    parser.add_argument("--ds-python", default=os.environ.get("DEEPSHARD_DEEPSPEED_PYTHON",
                                                              str(REPO / ".venv-deepspeed/bin/python")))
    parser.add_argument("--ds-pythonpath", default="", help="extra PYTHONPATH for DeepSpeed's side (its pytest)")
    parser.add_argument("--deepshard-python", default=sys.executable,
                        help="the interpreter of deepshard's side (a relative path is taken from the current "
                             "folder: pytest runs in a copy of the tests)")
    parser.add_argument("--checkout-label", help="the checkout's commit, where it is not a git repository")
    parser.add_argument("--no-preload", action="store_true",
                        help="workers import torch and deepspeed themselves (slower; for checking the preload)")
    args = parser.parse_args(argv)
    if os.sep in args.deepshard_python:  # a path (not a name looked up on PATH): pytest runs elsewhere
        args.deepshard_python = os.path.abspath(args.deepshard_python)

    unit_dir = args.checkout / "tests" / "unit"
    if not unit_dir.is_dir():
        raise SystemExit(f"{unit_dir} does not exist: --checkout must be a DeepSpeed repository root")
    files = [f for f in expand(unit_dir, args.files or default_globs())
             if not any(fnmatch.fnmatch(f, pattern) for pattern in args.exclude)]
    sides = SIDES if args.side == "both" else (args.side,)
    results = load_results(args.results)
    results["meta"].update(checkout_commit=args.checkout_label or _checkout_commit(args.checkout),
                           local_size=args.local_size)
    with tempfile.TemporaryDirectory(prefix="ds-unit-") as work:
        tests_dir = Path(work) / "tests"
        shutil.copytree(args.checkout / "tests", tests_dir)  # their files are read, never edited
        for rel in files:
            for side in sides:
                python = _venv_python(args.ds_python) if side == "deepspeed" else args.deepshard_python
                extra = args.ds_pythonpath if side == "deepspeed" else ""
                env = side_env(side, args.local_size, extra, min(args.timeout, 600), not args.no_preload)
                outcome = run_file(python, tests_dir, rel, env, args.timeout, args.keyword)
                sides_of_file = results["files"].setdefault(rel, {})
                if args.keyword and side in sides_of_file:
                    outcome = merge_outcome(sides_of_file[side], outcome)
                sides_of_file[side] = outcome
                args.results.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
                counts = _counts(outcome["tests"])
                print(f"{side:9} {rel}: {counts} in {outcome['seconds']}s"
                      + (" (timed out)" if outcome["timed_out"] else ""), flush=True)
    return 0


def merge_outcome(earlier: dict[str, Any], rerun: dict[str, Any]) -> dict[str, Any]:
    """A file's results after re-running some of its tests (``-k``): their new outcomes replace the old;
    the file counts as cut short only where the re-run was (an earlier time-out's unreached tests that
    the re-run reached are judged now)."""
    tests = {**earlier["tests"], **rerun["tests"]}
    unreached = any(entry["outcome"] == "not run" for entry in tests.values())
    return {**rerun, "tests": tests, "timed_out": rerun["timed_out"] or (earlier["timed_out"] and unreached),
            "seconds": round(earlier["seconds"] + rerun["seconds"], 1),
            "collect_errors": rerun["collect_errors"] or earlier["collect_errors"]}


def _counts(tests: dict[str, Any]) -> str:
    tally: dict[str, int] = {}
    for entry in tests.values():
        tally[entry["outcome"]] = tally.get(entry["outcome"], 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(tally.items())) or "nothing collected"


if __name__ == "__main__":
    sys.exit(main())
