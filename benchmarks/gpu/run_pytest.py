"""pytest for a time-limited phase: SIGTERM (and SIGINT, even where the caller left it ignored) stop the
session the way Ctrl-C does, so pytest still writes its --junitxml report of the tests that finished.

    timeout -s TERM 80 python -m benchmarks.gpu.run_pytest -q --device cuda tests/...
"""
from __future__ import annotations

import sys

import pytest

from benchmarks.gpu.common import stop_on_signals

if __name__ == "__main__":
    stop_on_signals()
    sys.exit(pytest.main(sys.argv[1:]))
