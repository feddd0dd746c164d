"""The launcher's entry points (``python -m deepshard.launcher``, DeepSpeed's ``launcher.runner``
path, ``--help`` with defaults, ``--version``, a bare command) and clean exits: a script that ends
right after a collective exits 0, never 134 ("terminate called without an active exception")."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.test_launcher import _clean_env, _free_port

import deepshard
from deepshard.launcher import runner

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
LAUNCHES = int(os.environ.get("DEEPSHARD_EXIT_LAUNCHES", "12"))
# the two ways a script ends right after a collective: on a tensor it still holds, and on a temporary
# (the gloo worker then frees the last reference and needs the GIL as the interpreter exits)
ENDINGS = ("end_after_collective.py", "end_after_temporary_collective.py")


def _module(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=_clean_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_help_version_and_bare_command() -> None:
    helped = _module("deepshard.launcher", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "(default: /job/hostfile)" in helped.stdout and "(default: 29500)" in helped.stdout
    assert "(default: )" not in helped.stdout and "(default: None)" not in helped.stdout
    version = _module("deepshard.launcher.runner", "--version")
    assert (version.returncode, version.stdout.strip()) == (0, f"deepshard {deepshard.__version__}")
    bare = _module("deepshard.launcher")
    assert bare.returncode == 2
    assert bare.stderr.startswith("usage: deepshard") and "positional arguments" in bare.stderr
    assert "required" not in bare.stderr


def test_runner_main_launches_and_logs_cpu_only_once(caplog, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("DEEPSHARD_ACCELERATOR", "cpu")
    caplog.set_level(logging.INFO, logger="deepshard")
    status = runner.main(["--master_port", str(_free_port()), str(SCRIPTS / "end_after_collective.py")])
    assert status == 0, caplog.text
    assert [r.getMessage() for r in caplog.records].count(
        "CPU only: starting 1 process; --num_gpus N starts N processes") == 1


def test_short_jobs_exit_zero_every_time() -> None:
    """Without deepshard's exit-time teardown about 3 launches in 8 ended with SIGABRT here; with a bare
    destroy_process_group at exit about 1 in 30 still did (the GIL race in utils/teardown.py)."""
    failures = []
    for first in range(0, LAUNCHES, 3):  # three jobs at a time: the wait for the rendezvous overlaps
        jobs = [subprocess.Popen([sys.executable, "-m", "deepshard.launcher", "--master_port", str(_free_port()),
                                  "--num_gpus", "2", "-q", str(SCRIPTS / ENDINGS[(first + index) % 2])],
                                 cwd=ROOT, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True) for index in range(min(3, LAUNCHES - first))]
        for index, job in enumerate(jobs):
            text = job.communicate(timeout=180)[0]
            if job.returncode != 0 or "terminate called" in text:
                failures.append(f"launch {first + index}: exit {job.returncode}\n{text}")
    assert not failures, "\n".join(failures)
