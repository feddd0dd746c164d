"""The benchmarks' process starter (``benchmarks/deepspeed_launch.py``): a run that hangs or loses a rank ends,
with every process it started killed, and a leftover DeepSpeed build lock is refused before anything starts."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.deepspeed_launch import deepspeed_env, start, wait_all  # noqa: E402

SLEEPER = [sys.executable, "-c", "import pathlib, subprocess, sys, time; "
           "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
           "pathlib.Path(sys.argv[1]).write_text(str(kid.pid)); time.sleep(60)"]


def _alive(pid: int) -> bool:
    try:
        Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_a_failed_rank_ends_the_run_and_kills_the_others(tmp_path: Path) -> None:
    with open(tmp_path / "log", "w") as log:
        procs = [start(SLEEPER + [str(tmp_path / "pid")], {}, log), start([sys.executable, "-c", "raise SystemExit(3)"], {}, log)]
        began = time.monotonic()
        failure = wait_all(procs, timeout=60)
    assert failure == "exit codes process 1: 3"
    assert time.monotonic() - began < 30
    assert procs[0].poll() is not None


def test_a_run_past_its_time_is_killed_with_what_it_started(tmp_path: Path) -> None:
    with open(tmp_path / "log", "w") as log:
        proc = start(SLEEPER + [str(tmp_path / "pid")], {}, log)
        while not ((tmp_path / "pid").exists() and (tmp_path / "pid").read_text()) and proc.poll() is None:
            time.sleep(0.05)  # the child exists
        kid = int((tmp_path / "pid").read_text())
        assert _alive(kid)
        failure = wait_all([proc], timeout=1.0)
    assert failure is not None and "still running after 1 s" in failure
    time.sleep(0.2)
    assert not _alive(kid)


def test_a_leftover_build_lock_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "fused_adam").mkdir()
    (tmp_path / "fused_adam" / "lock").write_text("")
    with pytest.raises(SystemExit, match="fused_adam/lock"):
        deepspeed_env({}, str(tmp_path), no_builds=True)
    env = deepspeed_env({"PYTHONPATH": "x"}, str(tmp_path / "elsewhere"), no_builds=True)
    assert env["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "elsewhere") and env["DS_ACCELERATOR"] == "cpu"
    assert env["PYTHONPATH"].endswith("ds_boot:x")
