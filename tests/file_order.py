"""The order in which the test files go out to pytest-xdist's workers: the longest first.

``make test`` runs ``-n 2 --dist loadfile --no-loadscope-reorder``: one worker runs a whole file, and
a worker takes the next file of the collection as it is about to run out of tests. Handed out in the
order collected (the folders alphabetically), a long file that comes late ends the run with one worker
still busy and the other idle. Handed out longest first, the long files start at once on both
workers and the many short ones fill in at the end, so both finish within a short file of each other
(the greedy "longest processing time first" rule).

The expected seconds per file are a checked-in table, ``file_seconds.json`` (wall seconds of each file
in a ``make test`` run on two cores); a file missing from it counts as ``UNKNOWN_SECONDS`` of its
folder, so a new file neither breaks the run nor goes last. Regenerate the table after a change
that moves a file's time much (seconds matter only relative to each other; the files of the given run replace
their rows, the others keep theirs)::

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests --timing-json /tmp/t.jsonl
    .venv/bin/python -m tests.file_order /tmp/t.jsonl

The order applies only to runs with xdist's ``--dist`` (a run in one process keeps the collection's
order, easier to read); the tests inside a file keep their written order either way.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLE = Path(__file__).with_name("file_seconds.json")
# a file not in the table yet: a guess by its folder (the spawning layers are long, the unit files short)
UNKNOWN_SECONDS = {"tests/e2e": 30.0, "tests/multiproc": 20.0, "tests/deepspeed_compat": 20.0}
UNKNOWN_DEFAULT = 1.0


def load_table(path: Path = TABLE) -> dict[str, float]:
    """``{test file: expected seconds}`` from ``path``; empty when there is none."""
    if not path.exists():
        return {}
    table = json.loads(path.read_text())
    if not isinstance(table, dict) or not all(isinstance(v, (int, float)) for v in table.values()):
        raise ValueError(f"{path}: expected a JSON object of test file -> seconds; regenerate it with "
                         "`python -m tests.file_order TIMES.jsonl`")
    return {str(k): float(v) for k, v in table.items()}


def expected_seconds(file: str, table: dict[str, float]) -> float:
    """The table's seconds for ``file``, else the guess for its folder."""
    if file in table:
        return table[file]
    folder = file.rsplit("/", 1)[0]
    return UNKNOWN_SECONDS.get(folder, UNKNOWN_DEFAULT)


def longest_first(files: list[str], table: dict[str, float]) -> list[str]:
    """``files`` (each once, in collection order) sorted by expected seconds, longest first; ties keep
    the collection's order."""
    return sorted(files, key=lambda f: -expected_seconds(f, table))


@pytest.hookimpl(trylast=True)  # after any other hook that filters or deselects items
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if getattr(config.option, "dist", "no") == "no":
        return
    by_file: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        by_file[item.nodeid.split("::")[0]].append(item)
    order = longest_first(list(by_file), load_table())
    items[:] = [item for file in order for item in by_file[file]]


def table_from_timing(lines: list[str]) -> dict[str, float]:
    """Wall seconds per file summed from ``--timing-json`` records (``tests/timing.py``), rounded."""
    seconds: dict[str, float] = defaultdict(float)
    for line in lines:
        if line.strip():
            record = json.loads(line)
            seconds[record["file"]] += float(record["wall"])
    return {file: round(s, 1) for file, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.file_order TIMES.jsonl  (from pytest --timing-json TIMES.jsonl)",
              file=sys.stderr)
        return 2
    measured = table_from_timing(Path(argv[0]).read_text().splitlines())
    # the files that ran take their new figures; the others keep theirs (a run of some files updates those)
    table = {f: s for f, s in load_table().items() if (ROOT / f).exists() and f not in measured}
    table.update(measured)
    table = dict(sorted(table.items(), key=lambda kv: -kv[1]))
    TABLE.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{TABLE}: {len(measured)} files measured, {len(table)} in the table, {sum(table.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
