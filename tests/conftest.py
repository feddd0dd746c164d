"""``--device cuda``: run the multi-process worlds on a CUDA GPU (see tests/multiproc/device.py).

Without the option the suite runs on the CPU with gloo, as CI does. ``--device cpu`` is the same run, and
also turns on the checks that exist for a device run (``tests/multiproc/test_device_world1.py``), so
they can be tried on a machine without a GPU.
"""
from __future__ import annotations

import os
from typing import Iterator

import pytest

from tests.multiproc.device import ENV, KINDS

pytest_plugins = ["tests.timing", "tests.watchdog"]  # the time per test file, printed at the end; a time limit per test


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", choices=KINDS, default=None,
                     help="run the multi-process tests' ranks on this device (default: cpu, the world-size-1 "
                          "device checks skipped)")


@pytest.fixture(autouse=True)
def _restore_process_state() -> Iterator[None]:
    """Put ``os.environ`` and the working directory back as they were before each test.

    A test that changes either without ``monkeypatch`` (or through code under test that writes
    ``os.environ`` itself, as the launcher-environment helpers do) would otherwise hand the change to every
    later test: a leaked ``RANK=3 WORLD_SIZE=4 MASTER_ADDR=10.0.0.7`` makes the next process group wait
    for peers that never come, and the subprocesses the tests start inherit it too.
    """
    environ, cwd = dict(os.environ), os.getcwd()
    yield
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    if os.getcwd() != cwd:
        os.chdir(cwd)


def pytest_configure(config: pytest.Config) -> None:
    kind = config.getoption("--device")
    if kind is None:
        return
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError("--device cuda: torch.cuda.is_available() is False on this machine "
                                    f"(torch {torch.__version__}); run without --device, or on a GPU machine")
    os.environ[ENV] = kind  # read by the spawned ranks (tests/multiproc/harness.py)
