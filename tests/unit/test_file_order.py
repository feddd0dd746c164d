"""The suite's own file order under xdist (``tests/file_order.py``): longest first by the checked-in table,
a file's tests kept together and in their written order, and the table regenerated from a timing run."""
from __future__ import annotations

import json
from pathlib import Path

from tests import file_order

ROOT = Path(__file__).resolve().parents[2]


def test_longest_first_with_folder_guesses_and_stable_ties() -> None:
    table = {"tests/unit/test_a.py": 5.0, "tests/e2e/test_b.py": 90.0, "tests/multiproc/test_c.py": 5.0}
    files = ["tests/unit/test_a.py", "tests/unit/test_new.py", "tests/multiproc/test_c.py", "tests/e2e/test_b.py",
             "tests/e2e/test_new.py"]
    # an unknown e2e file counts as 30 s, an unknown unit file as 1 s; equal figures keep the collection order
    assert file_order.longest_first(files, table) == ["tests/e2e/test_b.py", "tests/e2e/test_new.py",
                                                      "tests/unit/test_a.py", "tests/multiproc/test_c.py",
                                                      "tests/unit/test_new.py"]


def test_items_of_a_file_stay_together_in_order_and_only_under_xdist() -> None:
    class Item:
        def __init__(self, nodeid: str) -> None:
            self.nodeid = nodeid

    class Config:
        class option:  # noqa: N801 - stands in for pytest's namespace
            dist = "loadfile"

    items = [Item(n) for n in ("tests/unit/test_x.py::a", "tests/e2e/test_docs.py::p1", "tests/unit/test_x.py::b",
                               "tests/e2e/test_docs.py::p2", "tests/unit/test_zzz_unknown.py::c")]
    before = [i.nodeid for i in items]
    file_order.pytest_collection_modifyitems(Config, items)  # type: ignore[arg-type]
    after = [i.nodeid for i in items]
    assert sorted(after) == sorted(before)
    files = [n.split("::")[0] for n in after]
    assert files == sorted(files, key=files.index)  # each file's tests contiguous
    assert after.index("tests/e2e/test_docs.py::p1") < after.index("tests/e2e/test_docs.py::p2")
    assert after.index("tests/unit/test_x.py::a") < after.index("tests/unit/test_x.py::b")
    assert files[0] == "tests/e2e/test_docs.py" and files[-1] == "tests/unit/test_zzz_unknown.py"
    Config.option.dist = "no"
    items = [Item(n) for n in before]
    file_order.pytest_collection_modifyitems(Config, items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == before


def test_table_from_a_timing_run_sums_each_files_wall() -> None:
    lines = [json.dumps({"file": "tests/a.py", "wall": 1.25}), json.dumps({"file": "tests/b.py", "wall": 4.0}),
             "", json.dumps({"file": "tests/a.py", "wall": 2.0})]
    table = file_order.table_from_timing(lines)
    assert table == {"tests/b.py": 4.0, "tests/a.py": 3.2} and list(table) == ["tests/b.py", "tests/a.py"]


def test_the_checked_in_table_names_only_existing_test_files() -> None:
    table = file_order.load_table()
    assert table, f"{file_order.TABLE} is missing or empty"
    stale = [f for f in table if not (ROOT / f).is_file()]
    assert not stale, f"{file_order.TABLE} names files that are gone: {stale}; regenerate it (tests/file_order.py)"
