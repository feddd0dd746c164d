"""Progress bars (``deepshard.utils.progress``): on for rank 0 on a terminal or when asked, never on other
ranks; the items pass through unchanged either way."""
from __future__ import annotations

import io

import pytest

from deepshard.utils.progress import PROGRESS_ENV, bars_on, format_seconds, progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_who_shows_bars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert bars_on(_Tty()) and not bars_on(io.StringIO())  # a terminal, a pipe or file
    monkeypatch.setenv(PROGRESS_ENV, "0")
    assert not bars_on(_Tty())
    monkeypatch.setenv(PROGRESS_ENV, "1")
    assert bars_on(io.StringIO())
    monkeypatch.setenv("RANK", "1")
    assert not bars_on(_Tty())  # only rank 0 reports


def test_a_bar_counts_files_and_items_pass_through(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(PROGRESS_ENV, "1")
    monkeypatch.delenv("RANK", raising=False)
    assert list(progress(iter("abc"), "reading ckpt", total=3, unit="file")) == ["a", "b", "c"]
    assert "reading ckpt" in capsys.readouterr().err
    monkeypatch.setenv(PROGRESS_ENV, "0")
    assert list(progress(range(3), "quiet", total=3)) == [0, 1, 2]
    assert capsys.readouterr().err == ""
    assert (format_seconds(75.4), format_seconds(4000), format_seconds(9)) == ("1m15s", "1h06m", "9s")
