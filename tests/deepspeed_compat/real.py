"""Running a snippet under the real DeepSpeed 0.19.8 (its own venv, made by ``make deepspeed-venv``, or
``DEEPSHARD_DEEPSPEED_PYTHON``); where it lives and how its processes start are in ``ds_support``."""
from __future__ import annotations

import pytest

from tests.deepspeed_compat.ds_support import DS_PYTHON, DS_READY, REPO, run_in_deepspeed

__all__ = ["DS_PYTHON", "REPO", "needs_deepspeed", "run_deepspeed"]

needs_deepspeed = pytest.mark.skipif(
    not DS_READY, reason="needs the real DeepSpeed 0.19.8: make deepspeed-venv (needs the package index), or "
                         "point DEEPSHARD_DEEPSPEED_PYTHON at a python that has it")


def run_deepspeed(code: str, timeout: float = 300.0) -> str:
    """``code`` run by DeepSpeed's python on its CPU accelerator; its stdout (stderr too in the error)."""
    return run_in_deepspeed(["-c", code], f"the snippet {code[:60]!r}...", timeout=timeout)
