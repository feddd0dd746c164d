"""Starting processes for the benchmarks that run real DeepSpeed beside deepshard: where DeepSpeed's python
is, a free port, the environment of its processes, and a wait that always ends.

DeepSpeed 0.19.8 on CPU JIT-compiles C++ ops into ``TORCH_EXTENSIONS_DIR`` on first use (minutes each), and a
build killed halfway leaves a ``lock`` file on which every later DeepSpeed process waits silently, forever.
So every DeepSpeed process started here gets a build folder named by the caller (never the shared default),
the caller is told about leftover locks before it starts, and :func:`wait_all` kills a run's whole process
group when it passes its time limit or when one of its ranks fails (the others would wait for it in a
collective), instead of hanging. ``no_builds=True`` puts ``tests/deepspeed_compat/ds_boot`` first on the
path: its ``sitecustomize`` stops every op build (the shared-memory all-reduce is then absent and DeepSpeed
uses torch.distributed; the optimizer ops refuse to run), for runs that give DeepSpeed torch's optimizer.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import IO, Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
DS_BOOT = REPO_ROOT / "tests" / "deepspeed_compat" / "ds_boot"
DEFAULT_DS_PYTHON = os.environ.get("DEEPSHARD_DEEPSPEED_PYTHON", str(REPO_ROOT / ".venv-deepspeed" / "bin" / "python"))
DEFAULT_EXTENSIONS = "~/.cache/deepshard/cifar-tutorial-torch-extensions"


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def require_launcher(ds_python: str, program: str = "python") -> Path:
    """``program`` (``python``, ``deepspeed``) of the venv whose python is ``ds_python``; SystemExit if absent."""
    path = Path(ds_python).parent / program
    if not path.exists():
        raise SystemExit(f"no DeepSpeed {program} at {path}: pass --deepspeed-python PATH (the python of an "
                         "environment with deepspeed installed) or set DEEPSHARD_DEEPSPEED_PYTHON, or run "
                         "deepshard only")
    return path


def leftover_locks(extensions_dir: str) -> list[Path]:
    """Build locks under ``extensions_dir``: a build killed halfway leaves one and DeepSpeed then waits forever."""
    return sorted(Path(extensions_dir).expanduser().rglob("lock"))


def deepspeed_env(base: dict[str, str], extensions_dir: str, no_builds: bool) -> dict[str, str]:
    """``base`` plus what every DeepSpeed process needs here: its CPU accelerator, its own build folder, and
    (``no_builds``) the ``sitecustomize`` that stops op builds."""
    env = {**base, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(Path(extensions_dir).expanduser())}
    if no_builds:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(DS_BOOT), base.get("PYTHONPATH", "")) if p)
    locks = leftover_locks(extensions_dir)
    if locks:
        raise SystemExit(f"DeepSpeed build locks in {extensions_dir}: {', '.join(map(str, locks))}. A build killed "
                         "halfway leaves one and every DeepSpeed run then waits forever: delete them if no build "
                         "runs, or pass another --torch-extensions-dir")
    return env


def start(cmd: list[str], env: dict[str, str], log: IO[str], cwd: Optional[Path] = None) -> subprocess.Popen:
    """``cmd`` in a session of its own (so that :func:`wait_all` can end it with everything it started)."""
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def wait_all(procs: list[subprocess.Popen], timeout: float) -> Optional[str]:
    """Wait for every process; None when all ended with 0, else why not (a rank failed, or the time limit
    passed), after killing every process group still running."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            _kill(procs)
            return "exit codes " + ", ".join(f"process {i}: {c}" for i, c in failed)
        if all(c == 0 for c in codes):
            return None
        if time.monotonic() > deadline:
            _kill(procs)
            return f"still running after {timeout:.0f} s: killed"
        time.sleep(0.2)
