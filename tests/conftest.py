"""``--device cuda``: run the multi-process worlds on a CUDA GPU (see tests/multiproc/device.py).

Without the option the suite runs on the CPU with gloo, as CI does. ``--device cpu`` is the same run, and
also turns on the checks that exist for a device run (``tests/multiproc/test_device_world1.py``), so
they can be tried on a machine without a GPU.
"""
from __future__ import annotations

import os

import pytest

from tests.multiproc.device import ENV, KINDS

pytest_plugins = ["tests.timing"]  # the time per test file, printed at the end


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", choices=KINDS, default=None,
                     help="run the multi-process tests' ranks on this device (default: cpu, the world-size-1 "
                          "device checks skipped)")


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
