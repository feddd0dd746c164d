"""Where the real DeepSpeed 0.19.8 lives for the tests that compare with it (its own venv, made by
``make deepspeed-venv``, or ``DEEPSHARD_DEEPSPEED_PYTHON``), and running a snippet under it."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DS_VENV = REPO / ".venv-deepspeed"
DS_PYTHON = Path(os.environ.get("DEEPSHARD_DEEPSPEED_PYTHON", DS_VENV / "bin" / "python"))
DS_READY = "DEEPSHARD_DEEPSPEED_PYTHON" in os.environ or (DS_VENV / ".installed").exists()

needs_deepspeed = pytest.mark.skipif(
    not DS_READY, reason="needs the real DeepSpeed 0.19.8: make deepspeed-venv (needs the package index), or "
                         "point DEEPSHARD_DEEPSPEED_PYTHON at a python that has it")


def run_deepspeed(code: str, timeout: float = 300.0) -> str:
    """``code`` run by DeepSpeed's python on its CPU accelerator; its stdout (stderr too in the error)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([str(DS_PYTHON), "-c", code], capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(f"DeepSpeed's python failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout
