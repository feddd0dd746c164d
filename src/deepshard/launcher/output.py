"""The ranks' output on its way to the launcher's terminal, and how their ends are told and brought about (used by
torch's agent path, :mod:`.rank_streams`, and by the runner supervisor in :mod:`.multinode`)."""
from __future__ import annotations

import os
import re
import select
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, BinaryIO

TAIL_BYTES = 8192
PARTIAL_LINE_S = 0.05
FALLOUT_HOLD_S = 2.0
_FALLOUT = re.compile(rb"Connection closed by peer|Connection reset by peer|GLHF|Traceback \(most recent call last\)")


class Output:
    """The launcher's stdout, shared by the reader threads; a closed pipe stops forwarding only. After a
    failure (``hold()``) the other ranks' output waits in their ``held`` buffers so the report comes first;
    lost-connection lines are held :data:`FALLOUT_HOLD_S` and forwarded late (``flush_stale``) if nobody failed."""

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

    def write(self, chunk: bytes, child: Any = None) -> None:
        with self._lock:
            if child is not None and (self._holding or child.held or _FALLOUT.search(chunk)):
                if not child.held:
                    child.held_since = time.monotonic()
                child.held.extend(chunk)
                del child.held[:-TAIL_BYTES]
                return
            self._emit(chunk)

    def flush_stale(self, children: Sequence[Any], after_s: float) -> None:
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


def pump(stream: BinaryIO, child: Any, out: Output, log: BinaryIO | None, hold: bool = True) -> None:
    """Reader thread: copy one rank's output (into ``child.tail``, and ``held`` with ``hold``) until its pipe
    closes; complete lines go out at once, a partial line waits :data:`PARTIAL_LINE_S` so ranks do not splice."""
    pending = b""
    holder = child if hold else None
    try:
        while True:
            if pending and not select.select([stream], [], [], PARTIAL_LINE_S)[0]:
                out.write(pending, holder)
                pending = b""
                continue
            chunk = stream.read(65536)
            if not chunk:
                break
            if log is not None:
                log.write(chunk)
                log.flush()
            child.tail.extend(chunk)
            del child.tail[:-TAIL_BYTES]
            complete, pending = _split_complete(pending + chunk)
            if complete:
                out.write(complete, holder)
            if len(pending) > TAIL_BYTES:
                out.write(pending, holder)
                pending = b""
    finally:
        if pending:
            out.write(pending, holder)
        stream.close()
        if log is not None:
            log.close()


def exit_status(returncode: int | None) -> int:
    """The code a launcher exits with for a process that ended with ``returncode`` (1 for a signal)."""
    return returncode if returncode and returncode > 0 else 1


def signal_group(group: int | None, sig: int) -> None:
    """``sig`` to a process group (a rank and whatever it started), which may be gone already."""
    try:
        if group is not None:
            os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass


def describe_exit(returncode: int) -> str:
    """``Popen.returncode`` in words: ``code 3``, or ``signal SIGKILL`` for a negative code."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"code {returncode}"
