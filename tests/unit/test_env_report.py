"""The environment report: every console script resolves, and the report runs in a fresh interpreter."""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from deepshard.utils import env_report

ROOT = Path(__file__).resolve().parents[2]


def test_every_console_script_points_at_a_callable() -> None:
    """The bug this file was written for: ``ds_report_deepshard`` named a module that did not exist."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "ds_report_deepshard" in scripts
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name


def test_report_sections_and_rows() -> None:
    sections = env_report.collect()
    titles = [s.title for s in sections]
    assert titles[0] == "versions" and "optional features" in titles
    rows = {name: value for s in sections for name, value in s.rows}
    assert rows["torch"] == importlib.metadata.version("torch")
    assert rows["backend gloo"] == "yes"
    assert rows["processes"].isdigit() and int(rows["processes"]) >= 1
    assert "GB free" in rows["/dev/shm"] or "unavailable" in rows["/dev/shm"]
    text = env_report.format_sections(sections)
    assert "launcher plan" in text and "...." in text


def test_missing_feature_is_reported_not_raised(monkeypatch) -> None:
    monkeypatch.setitem(env_report.OPTIONAL_FEATURES, "imaginary", ("no-such-dist", "no_such_module_xyz"))
    rows = dict(env_report.features_section().rows)
    assert rows["imaginary"] == "no (pip install no-such-dist)"


def test_commands_run_in_a_fresh_interpreter() -> None:
    """Both spellings (the console script's target and ``deepshard report``) in a clean subprocess."""
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT / "src"), "HOME": os.environ.get("HOME", "/")}
    for code in ("from deepshard.utils.env_report import main; raise SystemExit(main(['--hide_operator_status']))",
                 "from deepshard.launcher.cli import main; raise SystemExit(main(['report']))"):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "versions" in out.stdout and "optional features" in out.stdout and "launcher plan" in out.stdout
