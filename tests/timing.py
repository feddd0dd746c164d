"""The suite's own time: wall and CPU seconds per test file, printed as a table at the end of the run.

CPU seconds are what decide where the suite's time goes on a shared or small machine (wall seconds grow
with the load, CPU seconds much less). They count this process, every child it has reaped (subprocesses,
launchers and their ranks) and the children still alive at the time of reading, with what those reaped
(the forkserver that starts the multi-process tests' ranks, ``tests/multiproc/harness.py``). A test's
figure includes the set-up of the fixtures it was first to need, so a module fixture counts once, in its
file.

The table appears when the run spans more than one file (``--timing-top N`` sets its length, and shows
it for one file too; 0 hides it); ``--timing-json PATH`` writes every test's figures (nodeid, file,
wall, cpu, worlds, ranks, the wall-clock time it ended and the xdist worker that ran it), one JSON object a
line as each test ends (a run stopped early keeps what it had): enough to see when each worker finished.

Under pytest-xdist (``-n 2``) each worker measures its own tests (its CPU seconds and its children's, so
two workers never count each other) and hands its records to the controller when it finishes; the
controller prints one table over all of them. The total CPU seconds are the tests' figures summed (the
workers' start-up and collection, a few seconds each, are not in it), and the last line says when each
worker's last test ended: the gap between them is the time one worker ran alone at the end.
"""
from __future__ import annotations

import json
import os
import resource
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import pytest

DEFAULT_TOP = 15
WORKER_KEY = "deepshard_timing"
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _live_children_cpu() -> float:
    """CPU seconds of this process's live children, with the children they reaped (Linux; else 0)."""
    total = 0.0
    me = os.getpid()
    try:
        tasks = Path(f"/proc/{me}/task").iterdir()
        pids = {int(p) for t in tasks for p in (t / "children").read_text().split()}
    except OSError:
        return 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited since the listing: counted by RUSAGE_CHILDREN once reaped
        total += sum(int(x) for x in fields[11:15]) / _TICK  # utime stime cutime cstime
    return total


def cpu_seconds() -> float:
    """This process's CPU seconds plus those of all its children, reaped or alive."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime + _live_children_cpu()


def _world_counts() -> tuple[int, int]:
    from tests.multiproc import harness

    return harness.STATS.worlds, harness.STATS.ranks


class SuiteTiming:
    """Collects each test's wall and CPU seconds and prints the per-file table at the end."""

    def __init__(self, top: int | None, json_path: str | None, worker_output: dict[str, Any] | None) -> None:
        self.top, self.json_path = top, json_path
        self.worker_output = worker_output  # an xdist worker's channel to the controller; None elsewhere
        self.records: list[dict[str, Any]] = []
        self.workers = 0  # xdist workers whose records arrived
        self.start_wall, self.start_time = time.monotonic(), time.time()
        self.start_load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
        if json_path and worker_output is None:  # the workers append to the file the controller emptied
            Path(json_path).write_text("")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        worlds, ranks = _world_counts()
        wall, cpu = time.monotonic(), cpu_seconds()
        yield
        worlds_after, ranks_after = _world_counts()
        record = {"nodeid": item.nodeid, "file": item.nodeid.split("::")[0], "wall": time.monotonic() - wall,
                  "cpu": cpu_seconds() - cpu, "worlds": worlds_after - worlds, "ranks": ranks_after - ranks,
                  "end": time.time(), "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
        self.records.append(record)
        if self.json_path:
            with open(self.json_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    @pytest.hookimpl(tryfirst=True)  # before xdist's worker sends its output to the controller
    def pytest_sessionfinish(self) -> None:
        if self.worker_output is not None:
            self.worker_output[WORKER_KEY] = self.records

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """xdist's controller: a worker finished; take the records it measured."""
        self.records.extend(getattr(node, "workeroutput", {}).get(WORKER_KEY, []))
        self.workers += 1

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.worker_output is not None:
            return
        files: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for r in self.records:
            row = files[r["file"]]
            for key in ("wall", "cpu", "worlds", "ranks"):
                row[key] += r[key]
            row["tests"] += 1
        top = self.top if self.top is not None else (DEFAULT_TOP if len(files) > 1 else 0)
        if top <= 0:
            return
        write = terminalreporter.write_line
        terminalreporter.section("time per test file (CPU seconds include every child process)")
        write(f"{'file':<58} {'tests':>5} {'wall s':>8} {'CPU s':>8} {'worlds':>6}")
        for name, row in sorted(files.items(), key=lambda kv: -kv[1]["cpu"])[:top]:
            write(f"{name:<58} {int(row['tests']):>5} {row['wall']:>8.1f} {row['cpu']:>8.1f} {int(row['worlds']):>6}")
        wall = time.monotonic() - self.start_wall
        # the tests' own figures, summed: the controller's reading of its children would miss the ranks that a
        # worker's forkserver (alive until the worker exits) has reaped, most of the multi-process tests' CPU
        cpu = sum(r["cpu"] for r in self.records)
        worlds = sum(int(r["worlds"]) for r in self.records)
        ranks = sum(int(r["ranks"]) for r in self.records)
        load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
        cores = os.cpu_count() or 1
        write(f"total: {len(self.records)} tests in {len(files)} files, {wall:.0f} s wall, {cpu:.0f} CPU s "
              f"({cpu / cores:.0f} s on {cores} idle cores at best), {worlds} worlds of {ranks} ranks; "
              f"load average {self.start_load[0]:.1f} at the start, {load[0]:.1f} at the end"
              + (f"; {self.workers} xdist workers" if self.workers else ""))
        ends = self._worker_ends()
        if len(ends) > 1:
            write("each worker's last test ended at " + ", ".join(f"{w} {s:.0f} s" for w, s in ends.items())
                  + " (from the start of the run)")

    def _worker_ends(self) -> dict[str, float]:
        """Seconds from the start of the run to each xdist worker's last test end: the run's tail."""
        ends: dict[str, float] = {}
        for r in self.records:
            if r.get("worker"):
                ends[r["worker"]] = max(ends.get(r["worker"], 0.0), r["end"] - self.start_time)
        return dict(sorted(ends.items()))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("timing", "the suite's own time per test file")
    group.addoption("--timing-top", type=int, default=None, metavar="N",
                    help=f"print the N test files that took the most CPU seconds at the end (0: no table; "
                         f"default: {DEFAULT_TOP} when more than one file ran)")
    group.addoption("--timing-json", default=None, metavar="PATH", help="write every test's wall and CPU seconds")


def pytest_configure(config: pytest.Config) -> None:
    top, json_path = config.getoption("--timing-top"), config.getoption("--timing-json")
    if top != 0 or json_path:
        worker_output = getattr(config, "workeroutput", None)  # set on pytest-xdist's workers only
        config.pluginmanager.register(SuiteTiming(top, json_path, worker_output), "deepshard-timing")
