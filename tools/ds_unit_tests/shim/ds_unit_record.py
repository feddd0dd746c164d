"""pytest plugin (``-p ds_unit_record``) the runner adds to each DeepSpeed test file's run: per test id the
outcome (passed, failed, error, skipped, or not run when the file was cut short), the first line of why,
and the world sizes it spawns; written as JSON to ``$DS_UNIT_RESULTS`` after every test, so a run killed
by its timeout still reports what finished."""
from __future__ import annotations

import json
import os
from typing import Any

import pytest

_RESULTS: dict[str, dict[str, Any]] = {}
_COLLECT_ERRORS: list[str] = []


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


def _why(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
        return _first_line(str(longrepr[2]).removeprefix("Skipped: "))
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return _first_line(crash.message)
    return _first_line(str(longrepr))


def _world_sizes(item: pytest.Item) -> list[int]:
    """The process counts DeepSpeed's DistributedTest launches for ``item`` (1 for a plain test)."""
    cls = getattr(item, "cls", None)
    if cls is None or not getattr(cls, "is_dist_test", False):
        return [1]
    marker = item.get_closest_marker("world_size")
    sizes = marker.args[0] if marker is not None else getattr(cls, "world_size", 2)
    return list(sizes) if isinstance(sizes, (list, tuple)) else [int(sizes)]


def _dump() -> None:
    path = os.environ.get("DS_UNIT_RESULTS")
    if path:
        with open(path + ".tmp", "w") as out:
            json.dump({"tests": _RESULTS, "collect_errors": _COLLECT_ERRORS}, out, indent=1)
        os.replace(path + ".tmp", path)


def _collect_why(report: pytest.CollectReport) -> str:
    """The exception line of a collection error (``E   ImportError: ...``), not pytest's preamble."""
    text = str(report.longrepr)
    raised = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    return raised[-1][:300] if raised else _first_line(text)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _COLLECT_ERRORS.append(_collect_why(report) or "collection failed")
        _dump()


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only the tests that will run are "not run" yet
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        _RESULTS[item.nodeid] = {"outcome": "not run", "ws": _world_sizes(item), "why": "", "seconds": 0.0}
    _dump()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _RESULTS.setdefault(report.nodeid, {"outcome": "not run", "ws": [1], "why": "", "seconds": 0.0})
    entry["seconds"] = round(entry["seconds"] + report.duration, 2)
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if report.skipped:
            entry["outcome"] = "skipped"
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
        else:
            entry["outcome"] = "passed"
        entry["why"] = _why(report)
    elif report.when == "teardown" and report.failed and entry["outcome"] == "passed":
        entry["outcome"], entry["why"] = "error", "teardown: " + _why(report)
    if report.when == "teardown":
        _dump()
