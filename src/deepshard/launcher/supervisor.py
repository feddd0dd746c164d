"""Run local ranks as child processes: forward their output, stop them all when one fails, reap all.

How it works:

* Each rank runs in its own session and process group (``start_new_session``), so a signal sent to
  the group reaches the rank and anything it started (data-loader workers, helpers).
* One reader thread per rank copies the rank's stdout+stderr (merged into one pipe) to the
  launcher's stdout in raw chunks as they arrive (a partial line waits up to 50 ms for its end, so
  ranks' lines are not spliced), so ``\\r`` progress bars keep working; it keeps the
  last :data:`TAIL_BYTES` for the failure report and, with a log directory, writes ``rank_<N>.log``.
* One waiter thread per rank blocks in ``wait()`` and queues the rank's index when it exits, so the
  launcher learns exit order exactly and the *first* failing rank is the one reported.
* When a rank exits non-zero (or by a signal), every other rank's group gets SIGTERM, then SIGKILL
  after :data:`GRACE_S` seconds; the report names the rank and prints the tail of its output.
* SIGINT / SIGTERM sent to the launcher are forwarded to every rank the same way.
* CPU binding: the launcher pins its own (main) thread to the rank's cores just around ``Popen``, so
  the child inherits the mask; no ``preexec_fn`` runs in the forked child (unsafe with threads).
* Multi-node hooks (:func:`supervise_ranks`): ``watch`` is polled every :data:`_POLL_S` seconds and
  stops every rank when it returns a reason (another node failed); ``on_failure`` is called with the
  failed rank *before* the others are stopped, so a node agent can tell the other nodes at once;
  ``settle_s`` lets the others end on their own first (ssh clients whose remote agents stop
  themselves, printing their reports); a spec with ``stdin_pipe`` gets a stdin pipe that the
  launcher holds open, so the remote side sees end-of-file when the launcher goes away.
"""
from __future__ import annotations

import os
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from deepshard.launcher import rank_errors
from deepshard.launcher.local import RankSpec
from deepshard.launcher.preflight import prepare_log_dir
from deepshard.utils.logging import logger

TAIL_BYTES = 8192
GRACE_S = 5.0
_POLL_S = 0.1
PARTIAL_LINE_S = 0.05
FALLOUT_HOLD_S = 2.0
_FALLOUT = re.compile(rb"Connection closed by peer|Connection reset by peer|GLHF|Traceback \(most recent call last\)")


@dataclass
class _Child:
    spec: RankSpec
    proc: subprocess.Popen
    tail: bytearray = field(default_factory=bytearray)
    reader: threading.Thread | None = None
    waiter: threading.Thread | None = None
    log_path: str | None = None
    held: bytearray = field(default_factory=bytearray)
    """Output that arrived after a rank failed, printed after the report (see :class:`Output`)."""
    held_since: float = 0.0
    ended_at: float | None = None
    """``time.monotonic()`` when the rank exited."""


@dataclass(frozen=True)
class RankFailure:
    """The first rank (or runner process) of a group that exited non-zero."""

    rank: int
    local_rank: int
    pid: int
    returncode: int
    """``Popen.returncode``: the exit code, or ``-N`` for death by signal N."""
    tail: str
    """The last :data:`TAIL_BYTES` of its output."""
    log_path: str | None = None
    label: str | None = None

    @property
    def exit_code(self) -> int:
        """The code a launcher exits with for this failure (1 when the rank died by a signal)."""
        return self.returncode if self.returncode > 0 else 1

    def describe_exit(self) -> str:
        """``code 3`` or ``signal SIGKILL``."""
        return describe_exit(self.returncode)


@dataclass(frozen=True)
class GroupResult:
    """How a supervised group ended: every rank succeeded (``exit_code`` 0), one failed (``failure``),
    the launcher got a signal (``signal``), or ``watch`` asked to stop (``stopped_by``)."""

    exit_code: int
    failure: RankFailure | None = None
    signal: int | None = None
    stopped_by: str | None = None


class Output:
    """The launcher's stdout, shared by the reader threads; a closed pipe stops forwarding only.

    Once a rank fails (``hold()``, called by its waiter thread the moment it is reaped), the other ranks'
    output is held in their ``_Child.held`` instead: what they print then is mostly the fallout (a
    backend's "Connection closed by peer" traceback), and the launcher's report must come first. The
    report then prints it with that noise folded (:func:`fold_noise`). A lost-connection message that
    arrives *before* the failing rank is reaped (its sockets close as it exits, a moment before the
    launcher can see it gone) is held too, for :data:`FALLOUT_HOLD_S`: when no rank fails meanwhile,
    ``flush_stale`` forwards it late but intact."""

    def __init__(self) -> None:
        self._stream: BinaryIO | None = getattr(sys.stdout, "buffer", None)
        self._lock = threading.Lock()
        self._broken = False
        self._holding = False

    def hold(self) -> None:
        with self._lock:
            self._holding = True

    def release(self) -> None:
        with self._lock:
            self._holding = False

    def write(self, chunk: bytes, child: "_Child | None" = None) -> None:
        with self._lock:
            if child is not None and (self._holding or child.held or _FALLOUT.search(chunk)):
                if not child.held:
                    child.held_since = time.monotonic()
                child.held.extend(chunk)
                del child.held[:-TAIL_BYTES]
                return
            self._emit(chunk)

    def write_now(self, chunk: bytes) -> None:
        """Forward ``chunk`` even while holding."""
        with self._lock:
            self._emit(chunk)

    def flush_stale(self, children: Sequence["_Child"], after_s: float) -> None:
        """Forward output held longer than ``after_s`` while no rank has failed."""
        with self._lock:
            if self._holding:
                return
            for child in children:
                if child.held and time.monotonic() - child.held_since >= after_s:
                    self._emit(bytes(child.held))
                    child.held.clear()

    def _emit(self, chunk: bytes) -> None:
        if self._broken:
            return
        try:
            if self._stream is not None:
                self._stream.write(chunk)
                self._stream.flush()
            else:
                sys.stdout.write(chunk.decode("utf-8", errors="replace"))
                sys.stdout.flush()
        except (BrokenPipeError, ValueError):
            self._broken = True


def _split_complete(data: bytes) -> tuple[bytes, bytes]:
    """Split ``data`` after its last line end (``\n`` or ``\r``): (complete part, partial rest)."""
    cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
    return data[:cut], data[cut:]


def pump(stream: BinaryIO, child: Any, out: Output, log: BinaryIO | None) -> None:
    """Reader thread: copy one rank's output until its pipe closes.

    ``stream`` is unbuffered, so each ``read`` returns what the rank wrote so far. Text up to the last
    line end (``\n`` or tqdm's ``\r``) is forwarded at once; a trailing partial line waits at most
    :data:`PARTIAL_LINE_S` for its end, so two ranks' lines do not get spliced mid-line (``print``
    writes the text and the newline separately) while progress bars still update live.
    """
    pending = b""
    try:
        while True:
            if pending and not select.select([stream], [], [], PARTIAL_LINE_S)[0]:
                out.write(pending, child)
                pending = b""
                continue
            try:
                chunk = stream.read(65536)
            except OSError:
                break
            if not chunk:
                break
            if log is not None:
                log.write(chunk)
                log.flush()
            child.tail.extend(chunk)
            del child.tail[:-TAIL_BYTES]
            complete, pending = _split_complete(pending + chunk)
            if complete:
                out.write(complete, child)
            if len(pending) > TAIL_BYTES:
                out.write(pending, child)
                pending = b""
    finally:
        if pending:
            out.write(pending, child)
        stream.close()
        if log is not None:
            log.close()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_and_report(child: _Child, index: int, exits: queue.Queue, out: Output) -> None:
    """Waiter thread: reap the rank, end leftovers in its group, queue its index (a failure first holds
    the other ranks' output, so the launcher's report comes before their fallout)."""
    child.proc.wait()
    child.ended_at = time.monotonic()
    if child.proc.returncode != 0:
        out.hold()
    _signal_group(child.proc.pid, signal.SIGTERM)  # orphaned helpers of a rank that ended
    exits.put(index)


def _popen(spec: RankSpec) -> subprocess.Popen:
    """Start one rank; with ``spec.cores`` the main thread is pinned around the fork."""
    saved = os.sched_getaffinity(0) if spec.cores is not None else None
    try:
        if spec.cores is not None:
            os.sched_setaffinity(0, spec.cores)
        # stdout is read raw by the reader thread (bufsize=0: no Python buffer in between).
        stdin = subprocess.PIPE if spec.stdin_pipe else subprocess.DEVNULL
        return subprocess.Popen(spec.cmd, env=spec.env, stdin=stdin,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0,
                                start_new_session=True)
    finally:
        if saved is not None:
            os.sched_setaffinity(0, saved)


def _start(specs: Sequence[RankSpec], log_dir: str | None, out: Output,
           exits: queue.Queue) -> list[_Child]:
    children: list[_Child] = []
    try:
        for index, spec in enumerate(specs):
            log_path = os.path.join(log_dir, f"rank_{spec.rank}.log") if log_dir is not None else None
            log = open(log_path, "wb") if log_path is not None else None
            try:
                child = _Child(spec, _popen(spec), log_path=log_path)
            except OSError:
                if log is not None:
                    log.close()
                raise
            child.reader = threading.Thread(target=pump, args=(child.proc.stdout, child, out, log),
                                            name=f"deepshard-out-{spec.rank}", daemon=True)
            child.waiter = threading.Thread(target=_wait_and_report, args=(child, index, exits, out),
                                            name=f"deepshard-wait-{spec.rank}", daemon=True)
            children.append(child)
            child.reader.start()
            child.waiter.start()
    except OSError as exc:
        _stop(children, list(range(len(children))), signal.SIGTERM)
        rank = len(children)
        raise RuntimeError(f"cannot start rank {rank}: {' '.join(specs[rank].cmd)}: {exc}") from exc
    return children


def _close_stdin(child: _Child) -> None:
    if child.proc.stdin is not None and not child.proc.stdin.closed:
        try:
            child.proc.stdin.close()
        except OSError:
            pass


def _stop(children: Sequence[_Child], indices: Sequence[int], sig: int, grace_s: float = GRACE_S) -> None:
    """Send ``sig`` to the groups of ``indices``; SIGKILL what is left after ``grace_s``; reap all."""
    for i in indices:
        _close_stdin(children[i])
        _signal_group(children[i].proc.pid, sig)
    deadline = time.monotonic() + grace_s
    for i in indices:
        children[i].waiter.join(max(0.0, deadline - time.monotonic()))  # type: ignore[union-attr]
    for i in indices:
        _signal_group(children[i].proc.pid, signal.SIGKILL)
    for i in indices:
        children[i].waiter.join(2.0)  # type: ignore[union-attr]


def _join_readers(children: Sequence[_Child], timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    for child in children:
        child.reader.join(max(0.0, deadline - time.monotonic()))  # type: ignore[union-attr]


def describe_exit(returncode: int) -> str:
    """``Popen.returncode`` in words: ``code 3``, or ``signal SIGKILL`` for a negative code."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"code {returncode}"


def _failure_of(child: _Child) -> RankFailure:
    spec = child.spec
    return RankFailure(spec.rank, spec.local_rank, child.proc.pid, child.proc.returncode,  # type: ignore[arg-type]
                       bytes(child.tail).decode("utf-8", errors="replace").rstrip(), child.log_path,
                       spec.label)


def format_failure(failure: RankFailure, stopped: int, noun: str = "rank", with_tail: bool = True) -> str:
    """The failure report: who failed, how, and the end of its output (``with_tail``: not when the rank
    reported its error in words, printed just before)."""
    who = failure.label or f"rank {failure.rank} (local rank {failure.local_rank}, pid {failure.pid})"
    short = failure.label or f"rank {failure.rank}"
    plural = noun if stopped == 1 else noun + "s"
    lines = [f"deepshard: {who} exited with {failure.describe_exit()}; stopped the other {stopped} {plural}"]
    if with_tail and failure.tail:
        lines += [f"----- last output of {short} -----", failure.tail, f"----- end of {short} output -----"]
    elif with_tail:
        lines.append(f"({short} printed nothing)")
    if failure.log_path:
        lines.append(f"full log of {short}: {failure.log_path}")
    return "\n".join(lines)


class _SignalForwarder:
    """Record SIGINT/SIGTERM sent to the launcher (main thread only) and restore handlers after."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._saved: dict[int, object] = {}

    def __enter__(self) -> "_SignalForwarder":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signum)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def _wait_settle(exits: queue.Queue, running: set[int], settle_s: float, signals: "_SignalForwarder") -> None:
    """Let the still-running children end on their own for up to ``settle_s`` seconds (a signal to
    the launcher cuts the wait short)."""
    deadline = time.monotonic() + settle_s
    while running and time.monotonic() < deadline and not signals.received:
        try:
            running.discard(exits.get(timeout=min(_POLL_S, max(0.0, deadline - time.monotonic()))))
        except queue.Empty:
            continue


@dataclass
class _Hooks:
    watch: Callable[[], str | None] | None = None
    on_failure: Callable[[RankFailure], None] | None = None
    report: bool = True
    settle_s: float = 0.0
    noun: str = "rank"


_NOISE = re.compile(r"GLHF|Connection closed by peer|Connection reset by peer|Broken pipe|^frame #\d+|"
                    r"^Exception raised from|<omitting python frames>|\[c10d\]|ProcessGroupGloo|TCPStore|"
                    r"terminate called after|gloo::")


_OWN = re.compile(r"CollectiveTimeout|deepshard|^(\[rank\d+\]: )?[\w.]+(Error|Exception|Timeout): ")


def fold_noise(text: str) -> tuple[str, int]:
    """``text`` without the lines of a backend's lost-connection fallout (gloo's "Connection closed by
    peer" warnings, c10d's C++ frames), and how many lines were folded. Python's exception lines and the
    library's own diagnoses stay."""
    kept = [line for line in text.splitlines() if not _NOISE.search(line) or _OWN.search(line)]
    return "\n".join(kept).strip("\n"), len(text.splitlines()) - len(kept)


def early_exits(children: Sequence[_Child], failed: _Child) -> str | None:
    """A line naming the ranks that exited 0 before ``failed`` failed (they left the others waiting in
    their next collective), or None."""
    early = [c for c in children if c is not failed and c.proc.returncode == 0 and c.ended_at is not None
             and failed.ended_at is not None and c.ended_at <= failed.ended_at]
    if not early:
        return None
    names = ", ".join(c.spec.label or f"rank {c.spec.rank}" for c in early)
    lead = max(failed.ended_at - c.ended_at for c in early)  # type: ignore[operator]
    verb = "was" if len(early) == 1 else "were"
    return (f"deepshard: {names} exited 0 while the others were still running ({lead:.1f}s before "
            f"{failed.spec.label or 'rank ' + str(failed.spec.rank)} failed): {names} {verb} done while the "
            "others still expected it in their collectives. Every rank must run the same number of steps "
            "(and call save_checkpoint) alike; look for a rank-dependent loop bound, break or early return")


def _report_held(children: Sequence[_Child], failed: _Child) -> None:
    """The other ranks' output since the failure, after the report, their connection noise folded."""
    for child in children:
        if child is failed or not child.held:
            continue
        text, folded = fold_noise(bytes(child.held).decode("utf-8", errors="replace"))
        name = child.spec.label or f"rank {child.spec.rank}"
        if text:
            print(f"----- {name}'s output after the failure -----\n{text}", file=sys.stderr, flush=True)
        if folded:
            where = f" (in {child.log_path})" if child.log_path else ""
            print(f"deepshard: folded {folded} lines of {name}'s lost-connection fallout{where}",
                  file=sys.stderr, flush=True)


def _fail(children: list[_Child], index: int, running: set[int], exits: queue.Queue,
          hooks: _Hooks, signals: "_SignalForwarder", out: Output) -> GroupResult:
    """A child failed: tell ``on_failure`` (with its output so far), stop the rest, report first, then
    the others' output since (their connection noise folded)."""
    children[index].reader.join(1.0)  # type: ignore[union-attr]  # its last words, if its pipe closed
    failure = _failure_of(children[index])
    if hooks.on_failure is not None:
        hooks.on_failure(failure)
    others = sorted(running)
    if hooks.settle_s > 0:
        _wait_settle(exits, running, hooks.settle_s, signals)
    _stop(children, sorted(running) + [index], signal.SIGTERM)
    _join_readers(children)
    failure = _failure_of(children[index])
    if hooks.report:
        early = early_exits(children, children[index])
        if early is not None:
            print(early, file=sys.stderr, flush=True)
        errors = rank_errors.collect(os.environ.get(rank_errors.ERROR_DIR_ENV))
        reported = any(failure.rank in ranks for ranks in errors.values())
        if errors:
            print(rank_errors.format_errors(errors), file=sys.stderr, flush=True)
        print(format_failure(failure, len(others), hooks.noun, with_tail=not reported), file=sys.stderr,
              flush=True)
        _report_held(children, children[index])
    else:
        _flush_held([c for c in children if c is not children[index]], out)
    out.release()
    return GroupResult(failure.exit_code, failure=failure)


def _flush_held(children: Sequence[_Child], out: Output) -> None:
    """Forward held output as it is (no report to put first) and stop holding."""
    out.release()
    for child in children:
        if child.held:
            out.write(bytes(child.held))
            child.held.clear()


def _supervise(children: list[_Child], exits: queue.Queue, signals: _SignalForwarder,
               hooks: _Hooks, out: Output) -> GroupResult:
    running = set(range(len(children)))
    while running:
        if signals.received:
            sig = signals.received[0]
            print(f"deepshard: received {signal.Signals(sig).name}; forwarding it to {len(running)} "
                  f"running {hooks.noun}s", file=sys.stderr, flush=True)
            _stop(children, sorted(running), sig)
            _join_readers(children)
            _flush_held(children, out)
            return GroupResult(128 + sig, signal=sig)
        if hooks.watch is not None:
            reason = hooks.watch()
            if reason is not None:
                _stop(children, sorted(running), signal.SIGTERM)
                _join_readers(children)
                _flush_held(children, out)
                return GroupResult(1, stopped_by=reason)
        try:
            index = exits.get(timeout=_POLL_S)
        except queue.Empty:
            out.flush_stale(children, FALLOUT_HOLD_S)
            continue
        running.discard(index)
        if children[index].proc.returncode != 0:
            return _fail(children, index, running, exits, hooks, signals, out)
    _join_readers(children)
    _flush_held(children, out)
    return GroupResult(0)


def supervise_ranks(specs: Sequence[RankSpec], log_dir: str | None = None,
                    on_started: Callable[[list[int]], None] | None = None,
                    watch: Callable[[], str | None] | None = None,
                    on_failure: Callable[[RankFailure], None] | None = None,
                    report: bool = True, settle_s: float = 0.0, noun: str = "rank") -> GroupResult:
    """Start one process per spec and supervise them until all succeed, one fails, the launcher gets
    SIGINT/SIGTERM (forwarded), or ``watch()`` returns a reason to stop; every process is reaped.

    ``log_dir``: also write each process's output to ``log_dir/rank_<N>.log``. ``on_started`` gets
    the child pids once all started. ``on_failure`` gets the first failure before the others are
    stopped; ``settle_s`` gives the others that long to end on their own first. ``report`` prints
    the failure report (see :func:`format_failure`); ``noun`` names the children in messages.
    """
    if log_dir is not None:
        prepare_log_dir(log_dir)
    exits: queue.Queue = queue.Queue()
    out = Output()
    hooks = _Hooks(watch, on_failure, report, settle_s, noun)
    with _SignalForwarder() as signals:
        try:
            children = _start(specs, log_dir, out, exits)
        except RuntimeError as exc:
            print(f"deepshard: {exc}", file=sys.stderr, flush=True)
            return GroupResult(1)
        logger.info("started %d %ss: %s", len(children), noun,
                    ", ".join(f"{c.spec.label or 'rank ' + str(c.spec.rank)} pid {c.proc.pid}"
                              for c in children))
        if log_dir is not None:
            logger.info("per-rank logs: %s", ", ".join(str(c.log_path) for c in children))
        if on_started is not None:
            on_started([child.proc.pid for child in children])
        try:
            return _supervise(children, exits, signals, hooks, out)
        except BaseException:
            _stop(children, list(range(len(children))), signal.SIGKILL, grace_s=0.0)
            raise


def run_ranks(specs: Sequence[RankSpec], log_dir: str | None = None,
              on_started: Callable[[list[int]], None] | None = None) -> int:
    """Start one process per spec and supervise them; returns 0 when every rank exits 0, the failing
    rank's exit code (1 if it died by a signal) when one fails, or 128+N on a forwarded signal N.

    ``log_dir``: also write each rank's output to ``log_dir/rank_<N>.log``. ``on_started`` is called
    with the child pids once all ranks started.
    """
    return supervise_ranks(specs, log_dir=log_dir, on_started=on_started).exit_code
