"""The shared-memory transport's settings (DEEPSHARD_SHM, DEEPSHARD_SHM_SLOT_MB) and its check that a
peer's process still exists (a vanished peer fails the wait instead of hanging until the timeout)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from deepshard.comm import settings, shm_ring


def test_mode_reads_the_argument_then_the_variable() -> None:
    assert settings.mode_from(None, {}) is None and settings.mode_from(None, {"DEEPSHARD_SHM": "auto"}) is None
    assert settings.mode_from(None, {"DEEPSHARD_SHM": "0"}) is False and settings.mode_from(None, {"DEEPSHARD_SHM": "1"}) is True
    assert settings.mode_from(True, {"DEEPSHARD_SHM": "0"}) is True
    with pytest.raises(ValueError, match="DEEPSHARD_SHM='yes'.*auto, 1.*or 0"):
        settings.mode_from(None, {"DEEPSHARD_SHM": "yes"})


def test_weakly_ordered_cpus_keep_tcp() -> None:
    """The round counters rely on x86's in-order stores: elsewhere auto means TCP, and asking is refused."""
    assert settings.mode_from(None, {}, machine="x86_64") is None
    assert settings.mode_from(None, {}, machine="aarch64") is False
    assert settings.mode_from(None, {"DEEPSHARD_SHM": "0"}, machine="arm64") is False
    for value, env in ((None, {"DEEPSHARD_SHM": "1"}), (True, {})):
        with pytest.raises(ValueError, match="DEEPSHARD_SHM=1.*aarch64 CPU.*x86's in-order stores; unset it"):
            settings.mode_from(value, env, machine="aarch64")


def test_slot_size_in_mib_rounded_to_pages() -> None:
    assert settings.slot_bytes_from({}) == 1 << 20
    assert settings.slot_bytes_from({"DEEPSHARD_SHM_SLOT_MB": "0.5"}) == 1 << 19
    assert settings.slot_bytes_from({"DEEPSHARD_SHM_SLOT_MB": "0.000001"}) == 4096
    for bad in ("big", "0", "-1"):
        with pytest.raises(ValueError, match="DEEPSHARD_SHM_SLOT_MB"):
            settings.slot_bytes_from({"DEEPSHARD_SHM_SLOT_MB": bad})


def test_a_zombie_or_reaped_peer_is_not_alive() -> None:
    assert shm_ring._alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert shm_ring._alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while shm_ring._alive(child.pid) and time.monotonic() < deadline:  # a zombie until reaped
            time.sleep(0.01)
        assert not shm_ring._alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not shm_ring._alive(child.pid)
