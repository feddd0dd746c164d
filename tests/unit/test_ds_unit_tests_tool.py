"""tools/ds_unit_tests (the runner of DeepSpeed's own unit tests and the table made from its results), on a
small stand-in for a DeepSpeed checkout: outcomes and world sizes per test id, the shim reaching the test
process, and the counts and reasons of the generated table."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "ds_unit_tests"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"ds_unit_tests_{name}", TOOL / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


report = _load("report")
runner = _load("runner")

TEST_FILE = '''
import os
import pytest


class FakeDistributed:
    is_dist_test = True
    world_size = 2


def test_imports_deepspeed():
    import deepspeed
    assert "deepshard" in deepspeed.__version__


def test_fails():
    assert 1 == 2, "one is not two"


@pytest.mark.skip(reason="not on this machine")
def test_skips():
    pass


def test_sees_local_size():
    assert os.environ["LOCAL_SIZE"] == "2" and os.environ["DS_ACCELERATOR"] == "cpu"


class TestWorld(FakeDistributed):
    def test_two(self):
        pass

    @pytest.mark.world_size(1)
    def test_one(self):
        pass
'''


@pytest.fixture()
def checkout(tmp_path: Path) -> Path:
    unit = tmp_path / "ds" / "tests" / "unit" / "sub"
    unit.mkdir(parents=True)
    (unit.parent / "__init__.py").write_text("")
    (unit / "__init__.py").write_text("")
    (unit.parents[1] / "pytest.ini").write_text("[pytest]\nmarkers =\n    world_size: w\n")
    (unit / "test_fake.py").write_text(TEST_FILE)
    return tmp_path / "ds"


def test_runner_records_each_side_and_report_counts_them(checkout: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    results = tmp_path / "results.json"
    # the deepshard side's interpreter given relative to the caller's folder (pytest runs in another one)
    monkeypatch.chdir(Path(sys.executable).parent)
    # the "deepspeed" side here is this venv without the shim: `import deepspeed` fails there
    runner.main(["--checkout", str(checkout), "--files", "sub/test_*.py", "--results", str(results),
                 "--ds-python", sys.executable, "--deepshard-python", f"./{Path(sys.executable).name}",
                 "--timeout", "120"])
    data = json.loads(results.read_text())
    sides = data["files"]["sub/test_fake.py"]
    shard = {k.split("::", 1)[1]: v for k, v in sides["deepshard"]["tests"].items()}
    ds = {k.split("::", 1)[1]: v for k, v in sides["deepspeed"]["tests"].items()}
    assert shard["test_imports_deepspeed"]["outcome"] == "passed"
    assert ds["test_imports_deepspeed"]["outcome"] == "failed"
    assert "No module named 'deepspeed'" in ds["test_imports_deepspeed"]["why"]
    assert shard["test_fails"]["outcome"] == "failed" and "one is not two" in shard["test_fails"]["why"]
    assert shard["test_skips"] == {"outcome": "skipped", "why": "not on this machine", "ws": [1],
                                   "seconds": shard["test_skips"]["seconds"]}
    assert shard["test_sees_local_size"]["outcome"] == "passed"
    assert shard["TestWorld::test_two"]["ws"] == [2] and shard["TestWorld::test_one"]["ws"] == [1]

    reasons = tmp_path / "reasons.tsv"
    reasons.write_text("# pattern\treason\nsub/test_fake.py::test_fa*\tthe stand-in fails on purpose\n")
    out = tmp_path / "compat.md"
    report.main(["--results", str(results), "--reasons", str(reasons), "--out", str(out)])
    text = out.read_text()
    # passing on the "deepspeed" side: sees_local_size (ws 1), test_one (ws 1), test_two (ws 2); all pass on ours
    assert "| `sub/test_fake.py` | 6 | 2 / 1 | 2 / 1 | 100% |  |" in text
    assert "**Overall: 3 of the 3 tests that pass on DeepSpeed pass on deepshard (100%).**" in text


def test_rerun_of_some_tests_merges_into_the_file_results() -> None:
    """``-k``: the re-run tests' outcomes replace theirs, the others stay; an earlier time-out stops counting
    once the re-run reached every test it had left."""
    earlier = {"rc": 124, "timed_out": True, "seconds": 100.0, "collect_errors": [],
               "tests": {"f::a": {"outcome": "failed"}, "f::b": {"outcome": "passed"}, "f::c": {"outcome": "not run"}}}
    rerun = {"rc": 0, "timed_out": False, "seconds": 5.0, "collect_errors": [],
             "tests": {"f::a": {"outcome": "passed"}, "f::c": {"outcome": "skipped"}}}
    merged = runner.merge_outcome(earlier, rerun)
    assert {k: v["outcome"] for k, v in merged["tests"].items()} == {"f::a": "passed", "f::b": "passed",
                                                                     "f::c": "skipped"}
    assert merged["timed_out"] is False and merged["seconds"] == 105.0 and merged["rc"] == 0
    partial = runner.merge_outcome(earlier, {**rerun, "tests": {"f::a": {"outcome": "passed"}}})
    assert partial["timed_out"] is True  # f::c is still unreached


def test_report_lists_gaps_with_curated_or_first_line_reasons() -> None:
    def entry(outcome: str, why: str = "", ws: int = 1) -> dict:
        return {"outcome": outcome, "why": why, "ws": [ws], "seconds": 0.0}

    results = {"meta": {"checkout_commit": "edaa7221abc", "local_size": 2}, "files": {
        "a/test_x.py": {
            "deepspeed": {"tests": {"unit/a/test_x.py::t1": entry("passed"), "unit/a/test_x.py::t2": entry("passed"),
                                    "unit/a/test_x.py::t3": entry("passed", ws=2),
                                    "unit/a/test_x.py::t4": entry("skipped", "no fp16"),
                                    "unit/a/test_x.py::t5": entry("not run")}},
            "deepshard": {"tests": {"unit/a/test_x.py::t1": entry("passed"),
                                    "unit/a/test_x.py::t2": entry("failed", "AssertionError: 3 != 4"),
                                    "unit/a/test_x.py::t3": entry("error", "private engine method", ws=2)},
                          "collect_errors": []}},
        "moe/test_y.py": {"deepspeed": {"tests": {"unit/moe/test_y.py::m": entry("passed")}}}}}
    text = report.render(results, [("a/test_x.py::t3", "calls DeepSpeed's private _foo"),
                                   ("moe/*", "pending: mixture-of-experts")])
    assert "| `a/test_x.py` | 5 | 2 / 1 | 1 / 0 | 33% | 1 |" in text
    assert "| `moe/test_y.py` | 1 | 1 / 0 | pending | - |  |" in text
    assert "| `t2` | failed | AssertionError: 3 != 4 |" in text
    assert "| `t3` | error | calls DeepSpeed's private _foo |" in text
    assert "Not judged: pending: mixture-of-experts" in text
    assert "**Overall: 1 of the 3 tests that pass on DeepSpeed pass on deepshard (33%).**" in text
    assert "Not run yet" not in text
    partial = report.render(results, [], ["a/test_*.py", "moe/test_*.py", "comm/test_*.py", "launcher/test_*.py"])
    assert "do not cover (the overall figure above does not count them): `comm/test_*.py`, `launcher/test_*.py`." \
        in partial


def test_report_gives_a_second_figure_without_the_implementation_internal_files() -> None:
    """The overall line counts every judged file; the line under it leaves out the files that unit-test
    DeepSpeed's private implementation modules (report.IMPLEMENTATION_INTERNAL), naming each with its counts."""
    def tests(file: str, outcomes: list[str]) -> dict:
        return {f"unit/{file}::t{i}": {"outcome": o, "why": "", "ws": [1], "seconds": 0.0}
                for i, o in enumerate(outcomes)}

    files = {"a/test_x.py": (["passed"] * 4, ["passed", "passed", "passed", "failed"]),
             "v1/moe/test_autoep_unit.py": (["passed"] * 3, ["failed"] * 3),
             "checkpoint/test_autotp_uc_checkpoint.py": (["passed", "skipped"], ["failed", "skipped"])}
    results = {"meta": {}, "files": {name: {"deepspeed": {"tests": tests(name, ds)},
                                            "deepshard": {"tests": tests(name, ours), "collect_errors": []}}
                                     for name, (ds, ours) in files.items()}}
    assert report.is_implementation_internal("v1/moe/test_autoep_autotp_dispatch.py")
    assert report.is_implementation_internal("v1/moe/test_fused_expert_layout.py")
    assert not report.is_implementation_internal("v1/moe/test_moe.py")
    assert report.is_implementation_internal("v1/moe/test_autoep_checkpoint.py")  # imports autoep_universal helpers
    assert not report.is_implementation_internal("v1/moe/test_autoep_integration.py")  # public surface only
    text = report.render(results, [])
    assert "**Overall: 3 of the 8 tests that pass on DeepSpeed pass on deepshard (38%).**" in text
    assert "**Without the implementation-internal files: 3 of the 4 tests that pass on DeepSpeed pass on " \
           "deepshard (75%).** It leaves out 4 tests that pass on DeepSpeed, in 2 files, because" in text
    assert "`checkpoint/test_autotp_uc_checkpoint.py` (0 of 1), `v1/moe/test_autoep_unit.py` (0 of 3)." in text
    assert text.index("**Overall") < text.index("**Without the implementation-internal files")
