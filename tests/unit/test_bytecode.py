"""The suite compiles the checkout to bytecode before it starts (``tests/bytecode.py``), even where
``PYTHONDONTWRITEBYTECODE=1`` stops every process from writing its own."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from tests.bytecode import compile_checkout


def test_the_code_folders_get_their_pyc_whatever_the_environment_says(tmp_path: Path) -> None:
    for folder in ("src/pkg", "tests", "docs"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "src/pkg/mod.py").write_text("X = 1\n")
    (tmp_path / "tests/helper.py").write_text("Y = 2\n")
    (tmp_path / "docs/page.py").write_text("Z = 3\n")  # not a code folder: left alone
    code = "import sys; sys.path.insert(0, sys.argv[1]); from tests.bytecode import compile_checkout as c; " \
           "from pathlib import Path; c(Path(sys.argv[2]))"
    env = {"PYTHONDONTWRITEBYTECODE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parents[2]), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for source in ("src/pkg/mod.py", "tests/helper.py"):
        assert Path(importlib.util.cache_from_source(str(tmp_path / source))).is_file(), source
    assert not (tmp_path / "docs" / "__pycache__").exists()
    compile_checkout(tmp_path / "missing")  # no code folders at all: nothing to do, no error
