"""Running one trial: the launcher in a fresh process group of processes, stopped at a timeout."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from deepshard.autotuning.probe import ENV


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """End a trial: SIGTERM to the launcher (it forwards it to its ranks), then SIGKILL to whatever of
    the launcher and its descendants is still there after ``grace`` seconds."""
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for child in family:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def run_trial(launcher_args: list[str], script_args: list[str], exp_dir: Path, spec: dict[str, Any],
              timeout: float) -> tuple[str, dict[str, Any], str]:
    """Run ``deepshard <launcher_args> <script_args>`` with the probe spec; returns (status, metrics,
    detail): ``ok`` with the metrics, ``failed`` (non-zero exit, or no metrics written) or ``timeout``."""
    exp_dir.mkdir(parents=True, exist_ok=True)
    spec_path, log_path = exp_dir / "probe.json", exp_dir / "stdout.log"
    spec_path.write_text(json.dumps(spec))
    metric_path = Path(spec["metric_path"])
    if metric_path.exists():
        metric_path.unlink()
    env = dict(os.environ, **{ENV: str(spec_path)})
    cmd = [sys.executable, "-m", "deepshard.launcher", *launcher_args, *script_args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc)
            return "timeout", {}, f"stopped after {timeout:.0f} s (log: {log_path})"
    if code != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        reason = "out of memory" if "out of memory" in tail.lower() else f"exit status {code}"
        return "failed", {}, f"{reason} (log: {log_path})"
    if not metric_path.exists():
        return "failed", {}, (f"the script ended before step {spec['end_step']} and wrote no metrics; "
                              f"let it run longer than autotuning.end_profile_step (log: {log_path})")
    return "ok", json.loads(metric_path.read_text()), ""
