"""Offload settings copied from the docs: a missing ``nvme_path`` is created and the log says so (a
path such as ``/local_nvme`` would otherwise appear silently at the filesystem root); a partial
``ratio`` is refused with nvme as with cpu, never silently ignored."""
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


def test_partial_nvme_offload_is_refused_like_partial_cpu_offload() -> None:
    from deepshard.config import load_config
    from deepshard.zero.offload.policy import make_offload_policies

    section = {"device": "nvme", "nvme_path": "/unused", "ratio": 0.5}
    cfg = load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3, "offload_optimizer": section}}, 1)
    with pytest.raises(NotImplementedError, match=r"offload_optimizer.ratio=0.5 \(partial offload\)"):
        make_offload_policies(cfg.zero_optimization, cfg.aio, "cpu")
