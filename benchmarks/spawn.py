"""Run one benchmark case in ``nprocs`` fresh processes (gloo on 127.0.0.1) and collect their results.

Each case gets new interpreters, so no engine inherits another's allocations, hooks or imports. The
processes are started with ``MALLOC_MMAP_THRESHOLD_=65536`` (freed tensors go back to the kernel, so
the RSS tracks live tensors), ``OMP_NUM_THREADS`` = cores / processes, ``DS_ACCELERATOR=cpu`` and
``DEEPSHARD_ACCELERATOR=cpu``. A case that does not finish within ``timeout`` seconds is killed and
reported as ``error: timeout``.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def threads_per_process(nprocs: int) -> int:
    """Cores shared evenly by the processes (at least one thread each)."""
    return max(1, (os.cpu_count() or 1) // nprocs)


def worker_env(case: dict[str, Any], port: int) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(case["nprocs"]),
                "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(case["threads"]),
                "DS_ACCELERATOR": "cpu", "DEEPSHARD_ACCELERATOR": "cpu", "PYTHONPATH": os.pathsep.join(path),
                "PYTHONWARNINGS": "ignore"})
    return env


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # each rank leads its own session (start_new_session)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def run_case(case: dict[str, Any], timeout: float = 900.0) -> list[dict[str, Any]]:
    """Start the ranks of ``case`` (``engine``, ``workload``, ``dtype``, ``nprocs`` ...) and return
    their results in rank order; a rank that wrote nothing gets ``status: error`` and its log's tail."""
    nprocs = int(case["nprocs"])
    case = {**case, "threads": case.get("threads") or threads_per_process(nprocs), "timeout": timeout}
    with tempfile.TemporaryDirectory(prefix="deepshard-bench-") as tmp:
        case_path = Path(tmp) / "case.json"
        case_path.write_text(json.dumps(case))
        env = worker_env(case, free_port())
        procs, logs = [], []
        for rank in range(nprocs):
            log = open(Path(tmp) / f"rank{rank}.log", "w+b")  # noqa: SIM115 - closed below
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "benchmarks.worker", str(case_path), str(rank)], cwd=str(REPO_ROOT),
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))
        deadline = time.monotonic() + timeout
        timed_out = False
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                timed_out = time.monotonic() > deadline
                time.sleep(2.0)  # let the other ranks notice the failure and write their results
                _stop(procs)
                break
            time.sleep(0.05)
        results = [_read_rank(Path(tmp), rank, logs[rank], timed_out) for rank in range(nprocs)]
        for log in logs:
            log.close()
    return results


def _read_rank(tmp: Path, rank: int, log: Any, timed_out: bool) -> dict[str, Any]:
    path = tmp / f"rank{rank}.json"
    if path.exists():
        return json.loads(path.read_text())
    log.flush()
    log.seek(0)
    tail = log.read().decode(errors="replace")[-3000:]
    reason = f"timeout; log tail:\n{tail}" if timed_out else f"no result; log tail:\n{tail}"
    return {"rank": rank, "status": "error", "reason": reason}
