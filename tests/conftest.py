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

# the time per test file, printed at the end; a time limit per test; the longest files first to the xdist workers;
# the checkout compiled to bytecode once (for processes under PYTHONDONTWRITEBYTECODE=1)
pytest_plugins = ["tests.timing", "tests.watchdog", "tests.file_order", "tests.bytecode"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", choices=KINDS, default=None,
                     help="run the multi-process tests' ranks on this device (default: cpu, the world-size-1 "
                          "device checks skipped)")


@pytest.fixture(autouse=True)
def _restore_process_state() -> Iterator[None]:
    """Put ``os.environ``, the working directory and torch.distributed's default group back as they were.

    A test that changes either without ``monkeypatch`` (or through code under test that writes
    ``os.environ`` itself, as the launcher-environment helpers do) would otherwise hand the change to every
    later test: a leaked ``RANK=3 WORLD_SIZE=4 MASTER_ADDR=10.0.0.7`` makes the next process group wait
    for peers that never come, and the subprocesses the tests start inherit it too.
    """
    environ, cwd = dict(os.environ), os.getcwd()
    had_group = _default_group_exists()
    yield
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    if os.getcwd() != cwd:
        os.chdir(cwd)
    if not had_group and _default_group_exists():  # a test left torch.distributed initialized in this process
        import torch.distributed as dist

        dist.destroy_process_group()


def _default_group_exists() -> bool:
    """Whether this (pytest's own) process has a default process group; torch is not imported for it."""
    import sys

    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


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
