"""A missing ``nvme_path`` is created, and the log says so (a path copied from the docs, such as
``/local_nvme``, would otherwise appear silently at the filesystem root)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from deepshard.zero.offload.swapper import AsyncSwapper


def test_missing_nvme_path_is_created_and_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="deepshard")
    root = tmp_path / "missing" / "nvme"
    swapper = AsyncSwapper(root, rank=1)
    try:
        assert swapper.directory.parent == root and root.is_dir()
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and str(root) in warnings[0] and "created" in warnings[0]
        caplog.clear()
        second = AsyncSwapper(root, rank=1)  # the directory exists now: nothing to say
        second.close()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        swapper.close()
