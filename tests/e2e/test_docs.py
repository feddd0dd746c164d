"""Every code block of README.md and docs/*.md runs as written (see ``docsnippets.py`` for the rules
and the marks a page uses to skip or shorten a block): a page that drifts from the code fails here."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.docsnippets import Snippet, check_json, kind_of, parse_page

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
LAUNCH_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT = 240


def _scratch(tmp_path: Path) -> Path:
    """A directory laid out like the checkout's root: examples/, benchmarks/, src/, and .venv/ being
    the environment of the running Python (so '.venv/bin/deepshard' is this checkout's launcher)."""
    for name in ("examples", "benchmarks", "src"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    return tmp_path


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV_KEYS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(snippet: Snippet, kind: str, cwd: Path, before: str = "") -> None:
    code = before + snippet.runnable_code()
    if kind == "file":
        (cwd / snippet.mark("file")).write_text(code)  # type: ignore[operator]
        return
    if kind == "json":
        check_json(snippet)
        return
    cmd = [sys.executable, "-c", code] if kind == "python" else ["bash", "-e", "-c", code]
    try:
        done = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{snippet.where}: still running after {TIMEOUT} s; shorten it with a "
                             "'doctest: replace' mark") from exc
    assert done.returncode == 0, (f"{snippet.where}: the {kind} block exited {done.returncode}\n--- block\n"
                                  f"{code}--- output\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_block_of_the_page_runs(page: Path, tmp_path: Path) -> None:
    cwd = _scratch(tmp_path)
    script = ""  # the page's python so far, for blocks marked 'continues'
    for snippet in parse_page(page.read_text(), page.relative_to(ROOT).as_posix()):
        kind = kind_of(snippet)
        if kind in ("skip", "none"):
            continue
        before = script if snippet.mark("continues") is not None else ""
        _run(snippet, kind, cwd, before)
        if kind == "python":
            script = before + snippet.runnable_code()


def test_marks_are_checked() -> None:
    page = ("<!-- doctest: replace 100 => 2 -->\n```python\nprint(100)\n```\n\n"
            "<!-- doctest: skip needs a GPU -->\n```bash\nnvidia-smi\n```\n```text\nout\n```\n")
    first, second, third = parse_page(page, "p.md")
    assert (first.runnable_code(), kind_of(first)) == ("print(2)\n", "python")
    assert (kind_of(second), kind_of(third)) == ("skip", "none")
    with pytest.raises(ValueError, match="does not match"):
        parse_page("<!-- doctest: replace 7 => 2 -->\n```python\nprint(1)\n```\n", "p.md")[0].runnable_code()
    with pytest.raises(ValueError, match="needs a reason"):
        parse_page("<!-- doctest: skip -->\n```python\n```\n", "p.md")
    with pytest.raises(ValueError, match="not right above"):
        parse_page("<!-- doctest: skip x -->\ntext\n```python\n```\n", "p.md")
    with pytest.raises(ValueError, match="unknown doctest mark"):
        parse_page("<!-- doctest: skp x -->\n```python\n```\n", "p.md")
