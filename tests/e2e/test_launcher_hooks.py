"""The runner supervisor (ssh / pdsh / mpirun processes) with small real processes: ``settle_s`` lets the
others end on their own after one failed, a ``stdin_pipe`` stays open until the group is stopped, and
``--max_restarts`` on one machine (torch's agent)."""
from __future__ import annotations

import sys
import time

from deepshard.launcher.multinode import ProcessSpec, supervise_ranks
from deepshard.launcher.output import describe_exit
from tests.e2e.test_launcher import SCRIPTS, _gone, _launch


def _spec(rank: int, code: str, **kw: object) -> ProcessSpec:
    return ProcessSpec(rank, [sys.executable, "-c", code], {}, **kw)  # type: ignore[arg-type]


def test_a_failure_names_the_first_and_settle_lets_others_finish() -> None:
    started: list[int] = []
    slow_ok = "import time; time.sleep(1.5); print('done', flush=True)"
    specs = [_spec(0, "import os; print('bye', flush=True); os._exit(4)", label="node 0 (ssh a)"),
             _spec(1, slow_ok)]
    t0 = time.monotonic()
    code, failure = supervise_ranks(specs, on_started=started.extend, settle_s=10)
    settled = time.monotonic() - t0
    assert failure is not None and (failure.spec.rank, code, failure.text(), failure.spec.label) == \
        (0, 4, "bye", "node 0 (ssh a)")
    assert describe_exit(failure.proc.returncode) == "code 4"
    assert 1.4 < settled < 8  # rank 1 was left to finish its 1.5 s sleep, not stopped
    assert len(started) == 2 and all(_gone(pid) for pid in started)
    long_sleep = [specs[0], _spec(1, "import time; time.sleep(20)")]
    t0 = time.monotonic()
    supervise_ranks(long_sleep)  # without settle_s, rank 1 is stopped at once
    assert time.monotonic() - t0 < 10


def test_stdin_pipe_is_held_open_and_closed_on_stop() -> None:
    # the reader exits as soon as its stdin reaches end-of-file; the other process fails after ~1 s
    reader = "import sys; sys.stdin.read(); print('eof', flush=True)"
    t0 = time.monotonic()
    failing = _spec(1, "import time; time.sleep(1); exit(2)")
    code, failure = supervise_ranks([_spec(0, reader, stdin_pipe=True), failing])
    assert failure is not None and failure.spec.rank == 1 and code == 2 and time.monotonic() - t0 > 1.0
    assert supervise_ranks([_spec(0, reader)]) == (0, None)  # /dev/null: EOF at once


def test_max_restarts_on_one_machine() -> None:
    result = _launch(["--num_gpus", "2", "--max_restarts", "1", str(SCRIPTS / "fail_first_attempt.py")])
    assert result.returncode == 0, result.stdout + result.stderr
    # (rank 0 may be stopped before it prints on attempt 0: rank 1 fails at once)
    for line in ("rank 1 attempt 0", "rank 0 attempt 1", "rank 1 attempt 1"):
        assert line in result.stdout
    assert "attempt 0 failed (exit 3); restarting every rank (restart 1 of 1)" in result.stderr
    spent = _launch(["--num_gpus", "2", str(SCRIPTS / "fail_first_attempt.py")])
    assert spent.returncode == 3 and "attempt 1" not in spent.stdout
