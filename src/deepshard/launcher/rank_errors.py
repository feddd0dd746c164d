"""Errors the ranks reported in words rather than tracebacks, printed once by the launcher."""
from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from pathlib import Path

ERROR_DIR_ENV = "DEEPSHARD_ERROR_DIR"
VERBOSE_ENV = "DEEPSHARD_VERBOSE"

__all__ = ["ERROR_DIR_ENV", "VERBOSE_ENV", "collect", "error_dir", "format_errors", "report"]


def report(message: str, environ: Mapping[str, str] = os.environ) -> None:
    """A rank's side: tell the launcher (a file in ``DEEPSHARD_ERROR_DIR``) or, run alone, the terminal."""
    where = environ.get(ERROR_DIR_ENV)
    if where and os.path.isdir(where):
        Path(where, f"rank{environ.get('RANK', '0')}.txt").write_text(message, encoding="utf-8")
        return
    print(f"deepshard: error: {message}\n(set {VERBOSE_ENV}=1 for the traceback)", file=sys.stderr, flush=True)


@contextmanager
def error_dir(environ: MutableMapping[str, str]) -> Iterator[str]:
    """A fresh directory for the ranks' messages, named in ``environ`` (which the ranks inherit) while
    the launch runs; removed afterwards."""
    saved = environ.get(ERROR_DIR_ENV)
    with tempfile.TemporaryDirectory(prefix="deepshard-errors-", ignore_cleanup_errors=True) as path:
        environ[ERROR_DIR_ENV] = path
        try:
            yield path
        finally:
            if saved is None:
                environ.pop(ERROR_DIR_ENV, None)
            else:
                environ[ERROR_DIR_ENV] = saved


def collect(directory: str | None) -> dict[str, list[int]]:
    """``{message: [ranks that reported it]}`` from ``directory`` (empty when unset or missing)."""
    found: dict[str, list[int]] = {}
    if not directory or not os.path.isdir(directory):
        return found
    for path in sorted(Path(directory).glob("rank*.txt")):
        try:
            rank = int(path.stem[len("rank"):])
            message = path.read_text(encoding="utf-8").strip()
        except (ValueError, OSError):
            continue
        found.setdefault(message, []).append(rank)
    return {message: sorted(ranks) for message, ranks in found.items()}


def format_errors(errors: dict[str, list[int]]) -> str:
    """One ``deepshard: error`` paragraph per distinct message, naming its ranks."""
    lines = []
    for message, ranks in errors.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        lines.append(f"deepshard: error ({who}): {message}")
    lines.append(f"(the traceback: deepshard --verbose ..., or {VERBOSE_ENV}=1)")
    return "\n".join(lines)
