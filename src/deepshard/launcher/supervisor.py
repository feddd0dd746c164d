"""Run the processes that start a multi-node job (``ssh`` per node, ``pdsh``, ``mpirun`` / ``srun``) and stop them
together. The ranks themselves run under torch's elastic agent on each node (:mod:`.agent`)."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from deepshard.launcher.output import Output, describe_exit, exit_status, pump, signal_group, signal_handlers
from deepshard.utils.logging import logger

GRACE_S = 5.0
_POLL_S = 0.1


@dataclass(frozen=True)
class ProcessSpec:
    """One process the supervisor starts (an ssh, pdsh, mpirun or srun command); ``rank`` is its index, ``label``
    how reports name it (e.g. ``node 1 (ssh worker-1)``). ``stdin_pipe``: a stdin pipe the launcher holds open
    (ssh: the remote side sees end-of-file when the launcher dies); otherwise stdin is ``/dev/null``."""

    rank: int
    cmd: list[str]
    env: dict[str, str]
    label: str | None = None
    stdin_pipe: bool = False


@dataclass
class _Child:
    spec: ProcessSpec
    proc: subprocess.Popen
    tail: bytearray = field(default_factory=bytearray)
    reader: threading.Thread | None = None


@dataclass(frozen=True)
class RankFailure:
    """The first process of a group that exited non-zero (``returncode``: ``-N`` for signal N)."""

    rank: int
    pid: int
    returncode: int
    tail: str = ""
    label: str | None = None

    @property
    def exit_code(self) -> int:
        return exit_status(self.returncode)

    def describe_exit(self) -> str:
        return describe_exit(self.returncode)


@dataclass(frozen=True)
class GroupResult:
    """How a supervised group ended: all succeeded (``exit_code`` 0), one failed (``failure``), or the
    launcher got a signal (``signal``)."""

    exit_code: int
    failure: RankFailure | None = None
    signal: int | None = None


def _start(specs: Sequence[ProcessSpec], out: Output) -> list[_Child]:
    children: list[_Child] = []
    try:
        for spec in specs:
            proc = subprocess.Popen(spec.cmd, env=spec.env, stdin=subprocess.PIPE if spec.stdin_pipe else
                                    subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0,
                                    start_new_session=True)
            children.append(child := _Child(spec, proc))
            child.reader = threading.Thread(target=pump, args=(proc.stdout, child, out, None, False),
                                            name=f"deepshard-out-{spec.rank}", daemon=True)
            child.reader.start()
    except OSError as exc:
        _stop(children, signal.SIGTERM)
        failed = specs[len(children)]
        raise RuntimeError(f"cannot start {failed.label or ' '.join(failed.cmd)}: {exc}") from exc
    return children


def _stop(children: Sequence[_Child], sig: int, grace_s: float = GRACE_S) -> None:
    """``sig`` to the process groups of ``children`` still running (their stdin closed first); SIGKILL what is
    left after ``grace_s``; reap all and drain their output."""
    for child in children:
        if child.proc.stdin is not None:
            try:
                child.proc.stdin.close()
            except OSError:
                pass
        if child.proc.poll() is None:
            signal_group(child.proc.pid, sig)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
    for child in children:
        if child.reader is not None:
            child.reader.join(2.0)


def _ended(running: list[_Child]) -> list[_Child]:
    """Remove and return the children of ``running`` that exited (their orphaned helpers get SIGTERM)."""
    ended = [child for child in running if child.proc.poll() is not None]
    for child in ended:
        running.remove(child)
        signal_group(child.proc.pid, signal.SIGTERM)
    return ended


def _supervise(children: list[_Child], signals: list[int], settle_s: float, noun: str) -> GroupResult:
    running = list(children)
    while running:
        if signals:
            print(f"deepshard: received {signal.Signals(signals[0]).name}; forwarding it to {len(running)} running "
                  f"{noun}s", file=sys.stderr, flush=True)
            _stop(children, signals[0])
            return GroupResult(128 + signals[0], signal=signals[0])
        time.sleep(_POLL_S)
        failed = next((child for child in _ended(running) if child.proc.returncode != 0), None)
        if failed is not None:
            deadline = time.monotonic() + settle_s  # the others may end on their own (their agents heard of it)
            while running and time.monotonic() < deadline and not signals:
                time.sleep(_POLL_S)
                _ended(running)
            _stop(children, signal.SIGTERM)
            result = RankFailure(failed.spec.rank, failed.proc.pid, failed.proc.returncode,
                                 bytes(failed.tail).decode("utf-8", errors="replace").rstrip(), failed.spec.label)
            return GroupResult(result.exit_code, failure=result)
    _stop(children, signal.SIGTERM, 0.0)
    return GroupResult(0)


def supervise_ranks(specs: Sequence[ProcessSpec], on_started: Callable[[list[int]], None] | None = None,
                    settle_s: float = 0.0, noun: str = "process") -> GroupResult:
    """Start one process per spec and supervise them until all succeed, one fails (the others get
    ``settle_s`` seconds to end on their own, then are stopped), or the launcher gets SIGINT/SIGTERM
    (forwarded); every process is reaped. ``on_started`` gets the pids once all started."""
    signals: list[int] = []
    with signal_handlers(lambda signum, frame: signals.append(signum), (signal.SIGINT, signal.SIGTERM)):
        try:
            children = _start(specs, Output())
        except RuntimeError as exc:
            print(f"deepshard: {exc}", file=sys.stderr, flush=True)
            return GroupResult(1)
        logger.info("started %d %ss: %s", len(children), noun,
                    ", ".join(f"{c.spec.label or noun + ' ' + str(c.spec.rank)} pid {c.proc.pid}" for c in children))
        if on_started is not None:
            on_started([child.proc.pid for child in children])
        try:
            return _supervise(children, signals, settle_s, noun)
        except BaseException:
            _stop(children, signal.SIGKILL, grace_s=0.0)
            raise
