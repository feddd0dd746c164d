"""TRL and PEFT on deepshard against the same scripts on DeepSpeed 0.19.8: per-step losses (and GRPO's
rewards, and the LoRA adapter saved and reloaded), 2 processes each, CPU.

    python -m benchmarks.ecosystem.run_compare                      # every case
    python -m benchmarks.ecosystem.run_compare --cases sft_zero3 grpo_zero3 --json out.json

It needs an environment holding trl, peft, transformers, accelerate, datasets, deepspeed==0.19.8 and
deepshard (``make ecosystem-venv`` builds ``.venv-ecosystem``; run this module with its Python). Each case
runs twice, once per library, as 2 fresh processes with the launcher's variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT) and ``ACCELERATE_USE_DEEPSPEED=true``; the tiny model and tokenizer
(``tiny.py``) are written once to a scratch directory both read. The table printed lists, per case, the
largest relative difference of the per-step mean loss (and, for GRPO, whether the per-step rewards are
identical; for LoRA, the largest difference of the reloaded adapter's weights and logits). Exit status 1
when a case differs by more than ``--rtol`` (default 1e-5) or a run fails.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.ecosystem.cases import CASES

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
LIBRARIES = ("deepspeed", "deepshard")
EXTENSIONS = Path("~/.cache/deepshard/ecosystem-torch-extensions")
"""DeepSpeed compiles its CPU shared-memory collective op on first use: its own build directory, so a build
lock another program left behind cannot stall these runs."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(library: str, case: str, model_dir: Path, out: Path, world: int, timeout: float) -> dict[str, Any]:
    """Run ``case`` under ``library`` on ``world`` processes; rank 0's result (with ``seconds``) or ``error``."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    started = time.time()
    for rank in range(world):
        env = dict(os.environ)
        env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "ACCELERATE_USE_DEEPSPEED": "true", "DS_ACCELERATOR": "cpu", "DEEPSHARD_ACCELERATOR": "cpu",
                    "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                    "TORCH_EXTENSIONS_DIR": str(EXTENSIONS.expanduser()),
                    "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])})
        log = open(out / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "benchmarks.ecosystem.rank", library, case,
                                        str(model_dir), str(out)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                       cwd=REPO_ROOT), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, timeout - (time.time() - started))))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append("timeout")
        log.close()
    seconds = time.time() - started
    if any(c != 0 for c in codes):
        tail = (out / "rank0.log").read_text()[-3000:]
        return {"error": f"exit codes {codes}", "tail": tail, "seconds": seconds}
    result = json.loads((out / "rank0.json").read_text())
    result["seconds"] = seconds
    if "adapter_dir" in result:  # reloaded by a fresh process with neither library
        reloaded = out / "reloaded.json"
        subprocess.run([sys.executable, "-m", "benchmarks.ecosystem.reload", str(model_dir), result["adapter_dir"],
                        str(reloaded)], check=True, cwd=REPO_ROOT, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"})
        result.update(json.loads(reloaded.read_text()))
    (out / "rank0.json").write_text(json.dumps(result))  # with its time, for --reuse
    return result


def _reused(out: Path) -> dict[str, Any]:
    done = out / "rank0.json"
    if not done.exists():
        return {"error": f"--reuse: no finished run in {out}", "tail": "", "seconds": 0.0}
    result = json.loads(done.read_text())
    result["seconds"] = float(result.get("seconds", 0.0))
    return result


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare(case: str, ds: dict[str, Any], dsh: dict[str, Any]) -> dict[str, Any]:
    """Per-step loss differences (and rewards, adapter) of deepshard's run against DeepSpeed's."""
    row: dict[str, Any] = {"case": case, "steps": len(ds["logs"])}
    if len(ds["logs"]) != len(dsh["logs"]):
        row["error"] = f"{len(dsh['logs'])} logged steps on deepshard, {len(ds['logs'])} on DeepSpeed"
        return row
    row["loss_rel"] = [rel(b["loss"], a["loss"]) for a, b in zip(ds["logs"], dsh["logs"])]
    row["loss_abs"] = [abs(b["loss"] - a["loss"]) for a, b in zip(ds["logs"], dsh["logs"])]
    row["max_loss_rel"] = max(row["loss_rel"], default=0.0)
    row["max_loss_abs"] = max(row["loss_abs"], default=0.0)
    reward_keys = sorted(k for k in ds["logs"][0] if k == "reward" or k.startswith("rewards/"))
    if "reward" in ds["logs"][0]:  # GRPO: rewards of sampled completions, which must be the same samples
        row["rewards_identical"] = all(a[k] == b[k] for a, b in zip(ds["logs"], dsh["logs"]) for k in reward_keys)
        row["rewards"] = [[a["reward"], b["reward"]] for a, b in zip(ds["logs"], dsh["logs"])]
    elif reward_keys:  # DPO: implicit rewards, computed from log-probabilities
        row["max_rewards_abs"] = max(abs(a[k] - b[k]) for a, b in zip(ds["logs"], dsh["logs"]) for k in reward_keys)
    if "adapter" in ds:
        row["adapter_files_equal"] = ds["adapter_files"] == dsh["adapter_files"]
        row["adapter_max_abs"] = max(abs(x - y) for n in ds["adapter"]
                                     for x, y in zip(_flat(ds["adapter"][n]), _flat(dsh["adapter"][n])))
        row["logits_max_abs"] = max(abs(x - y) for x, y in zip(_flat(ds["reloaded_logits"]),
                                                              _flat(dsh["reloaded_logits"])))
    return row


def _flat(value: Any) -> list[float]:
    if isinstance(value, list):
        return [x for v in value for x in _flat(v)]
    return [float(value)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--atol", type=float, default=1e-9, help="a step also passes within this absolute difference "
                        "(GRPO's loss is beta x KL, about 1e-5, after the first step)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    parser.add_argument("--json", type=Path, help="write every run's logs and the table here")
    parser.add_argument("--scratch", type=Path, help="keep the runs' directories here (default: a temp dir)")
    parser.add_argument("--reuse", choices=LIBRARIES, nargs="+", default=[], help="take these libraries' runs from "
                        "an earlier --scratch where they finished (rerun only the others)")
    args = parser.parse_args(argv)
    from benchmarks.ecosystem.tiny import save_tiny

    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="deepshard-ecosystem-"))
    model_dir = save_tiny(scratch / "tiny")
    rows, runs, failed = [], {}, False
    for case in args.cases:
        results = {lib: _reused(scratch / case / lib) if lib in args.reuse else
                   run_world(lib, case, model_dir, scratch / case / lib, args.world, args.timeout)
                   for lib in LIBRARIES}
        runs[case] = results
        errors = {lib: r for lib, r in results.items() if "error" in r}
        if errors:
            failed = True
            for lib, r in errors.items():
                print(f"{case} on {lib}: {r['error']}\n{r['tail']}", file=sys.stderr)
            rows.append({"case": case, "error": ", ".join(f"{lib}: {r['error']}" for lib, r in errors.items())})
            continue
        row = compare(case, results["deepspeed"], results["deepshard"])
        row["seconds"] = {lib: round(r["seconds"], 1) for lib, r in results.items()}
        failed |= "error" in row or not all(r <= args.rtol or a <= args.atol
                                            for r, a in zip(row.get("loss_rel", []), row.get("loss_abs", [])))
        failed |= row.get("rewards_identical") is False
        rows.append(row)
        print(_line(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"table": rows, "runs": runs}, indent=1))
    return 1 if failed else 0


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['case']:<12} error: {row['error']}"
    text = (f"{row['case']:<12} steps {row['steps']}  max per-step loss diff: rel {row['max_loss_rel']:.2e}, "
            f"abs {row['max_loss_abs']:.2e}")
    if "max_rewards_abs" in row:
        text += f"  implicit rewards max abs diff {row['max_rewards_abs']:.2e}"
    if "rewards_identical" in row:
        text += f"  rewards identical: {row['rewards_identical']}"
    if "adapter_max_abs" in row:
        text += (f"  adapter files equal: {row['adapter_files_equal']}, adapter max abs diff "
                 f"{row['adapter_max_abs']:.2e}, reloaded logits max abs diff {row['logits_max_abs']:.2e}")
    return text + f"  ({row['seconds']['deepspeed']} s / {row['seconds']['deepshard']} s)"


if __name__ == "__main__":
    sys.exit(main())
