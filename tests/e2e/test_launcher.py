"""The ``deepshard`` launcher with real processes: 2 ranks on gloo, per-rank logs, --module,
--no_local_rank, a failing rank stopping the job, signal forwarding, and init_distributed alone."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
LAUNCH_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID",
                   "SLURM_NTASKS", "DEEPSHARD_ACCELERATOR")


def _deepshard() -> list[str]:
    exe = Path(sys.executable).with_name("deepshard")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("deepshard")
    if found:
        return [found]
    return [sys.executable, "-m", "deepshard.launcher.cli"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV_KEYS}
    env["DEEPSHARD_ACCELERATOR"] = "cpu"
    env.update(extra)
    return env


def _launch(args: list[str], timeout: float = 30, **env: str) -> subprocess.CompletedProcess:
    cmd = [*_deepshard(), "--master_port", str(_free_port()), *args]
    return subprocess.run(cmd, cwd=ROOT, env=_clean_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def sleeping_pids(proc: subprocess.Popen, count: int) -> list[int]:
    """Read the launcher's output until ``count`` ranks of ``scripts/sleep_forever.py`` said their pid."""
    pids: list[int] = []
    while len(pids) < count:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, f"the launcher ended before {count} ranks started"
        found = re.search(r"pid=(\d+) sleeping", line)
        if found:
            pids.append(int(found.group(1)))
    return pids


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_two_ranks_allreduce_with_local_rank_user_args_and_each_rank_log(tmp_path: Path) -> None:
    """One launch for both: each rank gets ``--local_rank``, the user's arguments and OMP_NUM_THREADS=1, and
    ``--enable_each_rank_log`` writes each rank's output to its own file, named on stderr. (That the
    launcher relays the ranks' output to its own stdout is checked by ``test_module_and_no_local_rank``.)"""
    log_dir = tmp_path / "logs"
    result = _launch(["--num_gpus", "2", "--enable_each_rank_log", str(log_dir), str(SCRIPTS / "allreduce.py"),
                      "--deepspeed", "--flag=x"])
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        path = log_dir / f"rank_{rank}.log"
        assert str(path) in result.stderr
        text = path.read_text()
        line = re.search(rf"rank {rank} ok local_rank=(\S+) env_local_rank=(\S+) world=(\d) omp=(\S+) "
                         rf"extra=(\[[^\]]*\])", text)
        assert line is not None, text
        assert line.groups() == (str(rank), str(rank), "2", "1", "['--deepspeed', '--flag=x']")
        assert f"rank {1 - rank} ok" not in text


def test_module_and_no_local_rank() -> None:
    pythonpath = os.pathsep.join(p for p in (str(SCRIPTS), os.environ.get("PYTHONPATH")) if p)
    result = _launch(["--num_gpus", "2", "--module", "--no_local_rank", "allreduce"], PYTHONPATH=pythonpath)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0 ok local_rank=None env_local_rank=0 world=2" in result.stdout
    assert "rank 1 ok local_rank=None env_local_rank=1 world=2" in result.stdout


def test_failing_rank_stops_the_job_and_reports_its_traceback() -> None:
    result = _launch(["--num_gpus", "2", str(SCRIPTS / "fail_rank1.py")], timeout=40)
    ended = time.time()
    assert result.returncode == 1, result.stdout + result.stderr
    failed_at = re.search(r"rank 1 failing at ([\d.]+)", result.stdout)
    assert failed_at is not None, result.stdout
    # rank 0 sleeps 60 s: the launcher must stop it soon after rank 1 fails (SIGTERM, <= 5 s grace).
    assert ended - float(failed_at.group(1)) < 10, "launcher took too long to stop a failed job"
    report = re.search(r"deepshard: rank 1 \(local rank 1, pid (\d+)\) exited with code 1; "
                       r"stopped the other 1 rank", result.stderr)
    assert report is not None, result.stderr
    tail = result.stderr[report.end():]
    assert "Traceback (most recent call last)" in tail
    assert "RuntimeError: boom from rank 1: deliberate failure" in tail
    started = re.search(r"rank 0 pid=(\d+) helper_pid=(\d+)", result.stdout)
    assert started is not None, result.stdout
    pids = [int(report.group(1)), int(started.group(1)), int(started.group(2))]
    deadline = time.monotonic() + 3
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in pids if not _gone(pid)] == []


def test_deepspeed_script_finds_deepshard_and_a_config_typo_is_one_line_once() -> None:
    """``deepshard --num_gpus 2 train.py`` runs a script that does ``import deepspeed`` (no DeepSpeed is
    installed in the test environment); a config typo on both ranks prints its one-line message once, no
    traceback (``--verbose`` shows it); ``--master_port 0`` picks a free port and logs it."""
    script = str(SCRIPTS / "config_typo.py")
    result = _launch(["--num_gpus", "2", "--master_port", "0", script, "--deepspeed", "ds.json"], timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert out.count("import deepspeed -> deepspeed from") == 2 and "src/deepshard/__init__.py" in out, out
    assert out.count("unknown config key 'zero_optimization.stgae'; did you mean 'stage'?") == 1, out
    assert "deepshard: error (ranks 0, 1)" in out or "deepshard: error (rank " in out, out
    assert "Traceback" not in out and "last output of" not in out, out
    assert re.search(r"--master_port 0: rendezvous on free port \d+", out), out
    # every rank failed: the report says what became of the other rank, never "stopped the other 0 ranks"
    assert re.search(r"exited with code 1; (the other 1 rank failed too|stopped the other 1 rank)\n", out), out
    verbose = _launch(["--num_gpus", "1", "--verbose", script], timeout=120)
    assert verbose.returncode == 1 and "Traceback (most recent call last)" in verbose.stdout + verbose.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_is_forwarded_to_the_running_ranks(sig: signal.Signals) -> None:
    """The report counts the ranks that were running (it said "0 running ranks" while 2 were training)."""
    cmd = [*_deepshard(), "--master_port", str(_free_port()), "--num_gpus", "2",
           str(SCRIPTS / "sleep_forever.py")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = sleeping_pids(proc, 2)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, err
    assert f"deepshard: received {sig.name}; forwarding it to 2 running ranks" in err, err
    assert all(_gone(pid) for pid in pids)


def test_bad_selection_exits_2_with_message(tmp_path: Path, capsys) -> None:
    """Errors found before any process starts: run in-process through the console script's main()."""
    from deepshard.launcher.cli import main

    hostfile = tmp_path / "hostfile"
    script = str(SCRIPTS / "allreduce.py")
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    assert main(["-H", str(hostfile), "--no_ssh", script]) == 2
    err = capsys.readouterr().err
    assert "--no_ssh needs --node_rank N" in err and "(worker-0, worker-1)" in err
    assert main(["-H", str(hostfile), "--no_ssh", "--node_rank", "2", script]) == 2
    assert "--node_rank 2 is out of range" in capsys.readouterr().err
    hostfile.write_text("worker-0 slots=2\nworker-0 slots=2\n")
    assert main(["-H", str(hostfile), script]) == 2
    assert f"{hostfile}:2" in capsys.readouterr().err
    assert main(["--num_gpus", "2", "no_such_script.py"]) == 2
    assert "no_such_script.py" in capsys.readouterr().err


def test_init_distributed_without_launcher_is_world_of_one() -> None:
    result = subprocess.run([sys.executable, str(SCRIPTS / "world_of_one.py")], cwd=ROOT, env=_clean_env(),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "world_size=1 rank=0 backend=gloo sum=5.0" in result.stdout


def test_ranks_in_different_collectives_end_with_the_watchdog_diagnosis_in_the_report(tmp_path: Path) -> None:
    result = _launch(["--num_gpus", "2", str(SCRIPTS / "diverged_collective.py"), str(tmp_path)], timeout=90)
    assert result.returncode != 0, result.stdout + result.stderr
    report = result.stderr[result.stderr.find("deepshard: rank"):]
    assert "CollectiveTimeout" in report, result.stderr
    assert "is waiting in a different collective" in report or "did not arrive" in report, report
    assert "save_checkpoint's barrier" in report or "all_reduce" in report, report
    assert "finished without noticing" not in result.stdout


def _launch_merged(args: list[str], timeout: float) -> tuple[int, str, float]:
    """(exit code, stdout and stderr interleaved as printed, seconds)."""
    cmd = [*_deepshard(), "--master_port", str(_free_port()), *args]
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=ROOT, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=timeout)
    return result.returncode, result.stdout, time.monotonic() - start


def test_a_rank_that_ends_its_loop_early_is_named_by_the_launcher() -> None:
    """Rank 1 skips an iteration and exits 0 while rank 0 waits in its last one: the report used to blame
    rank 0 alone. Now it says first that rank 1 exited 0 while the others were still running."""
    code, text, seconds = _launch_merged(["--num_gpus", "2", str(SCRIPTS / "rank_leaves_early.py"), "skip"], 90)
    assert code == 1, text
    early = text.find("deepshard: rank 1 exited 0 while the others were still running")
    report = text.find("deepshard: rank 0 (local rank 0")
    assert 0 <= early < report, text
    assert "CollectiveTimeout" in text[report:] and "step 2" in text[report:], text
    assert "rank 1 finished its loop" in text and "rank 0 finished its loop" not in text, text
    assert seconds < 60, seconds


def test_the_report_comes_before_the_other_ranks_fallout_which_is_folded() -> None:
    """Rank 1 raises while rank 0 is in a collective: rank 0's lost-connection traceback used to print
    before the launcher's report. Now the report (rank 1's traceback) comes first, then rank 0's output
    without the backend's connection noise."""
    code, text, seconds = _launch_merged(["--num_gpus", "2", str(SCRIPTS / "rank_leaves_early.py"), "crash"], 90)
    assert code == 1, text
    report = text.find("deepshard: rank 1 (local rank 1")
    assert report >= 0 and "rank 1 fails on purpose" in text[report:], text
    before = text[:report]
    assert "CollectiveTimeout" not in before and "Connection closed" not in before, before
    after = text[report:]
    assert "rank 0's output after the failure" in after and "torch.distributed.all_reduce" in after, after
    assert "Connection closed by peer" in after and "frame #" not in after, after
    assert seconds < 60, seconds
