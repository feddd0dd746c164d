"""Huge-page advice for large host buffers: given where the kernel offers it, never changes a value."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepshard.utils import hugepages


def _thp_available() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[never]" not in path.read_text()


@pytest.fixture(autouse=True)
def _fresh_cache():
    hugepages._madvise.cache_clear()
    yield
    hugepages._madvise.cache_clear()


@pytest.mark.skipif(not _thp_available(), reason="this kernel offers no transparent huge pages")
def test_a_large_cpu_buffer_is_advised_and_keeps_what_is_written() -> None:
    buf = torch.empty(hugepages.MIN_BYTES // 4 * 2)
    assert hugepages.advise_huge_pages(buf)
    src = torch.arange(buf.numel(), dtype=torch.float32)
    buf.copy_(src)
    assert torch.equal(buf, src)


def test_small_buffers_and_the_switch_off_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not hugepages.advise_huge_pages(torch.empty(1024))
    monkeypatch.setenv("DEEPSHARD_HUGEPAGES", "0")
    hugepages._madvise.cache_clear()
    assert not hugepages.advise_huge_pages(torch.empty(hugepages.MIN_BYTES // 4 * 2))
