"""A per-test time limit: a test that runs past it fails, with every thread's stack printed, and the run goes on.

Each test (set-up, call and tear-down together, so a fixture that starts a world counts) gets
``DEEPSHARD_TEST_TIMEOUT`` seconds, 900 by default: far above the slowest test on a loaded 2-core machine
(about 4 minutes), far below CI's limit for the whole run. Past it, SIGALRM prints the stack of every thread
to stderr (where the test was waiting) and raises ``TestTimeout`` in the main thread, which the harness and the
subprocess helpers turn into killing what they started. A wait in C code that never returns to Python (where
the signal handler would run) still shows its stacks, 30 s later, from faulthandler's own watchdog thread.
``DEEPSHARD_TEST_TIMEOUT=0`` turns the limit off (for a debugger). Only where SIGALRM exists (not Windows).
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
from typing import Any, Iterator

import pytest

TIMEOUT_ENV = "DEEPSHARD_TEST_TIMEOUT"
DEFAULT_SECONDS = 900


class TestTimeout(Exception):
    """A test ran past ``DEEPSHARD_TEST_TIMEOUT`` seconds."""

    __test__ = False  # not a test class for pytest to collect


def _limit() -> int:
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_SECONDS))
    try:
        return int(raw)
    except ValueError:
        raise pytest.UsageError(f"{TIMEOUT_ENV}={raw!r}: give whole seconds (0 turns the limit off)") from None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    seconds = _limit()
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        sys.stderr.write(f"\n{item.nodeid} ran past {seconds} s ({TIMEOUT_ENV}); every thread's stack:\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        raise TestTimeout(f"{item.nodeid} ran past {seconds} s (its set-up, call and tear-down together); "
                          f"the stacks above show where it waited. Raise {TIMEOUT_ENV} if it is only slow")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    faulthandler.dump_traceback_later(seconds + 30, file=sys.__stderr__)
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)
