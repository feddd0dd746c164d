"""The checkout's Python files compiled to bytecode once, before any test starts.

The suite starts several hundred Python processes (each launch's ranks, the docs pages' blocks, the
examples, DeepSpeed's side), and most import deepshard from ``src/``, not from an installed copy. Where
``PYTHONDONTWRITEBYTECODE=1`` is set (many CI images and containers set it; this machine's shells do) no
process writes a ``.pyc``, so every one of them compiles each deepshard module it imports from source
again: about 0.2 CPU seconds a process that builds an engine (pip compiles what it installs, so torch and
the other packages are not concerned). ``compileall`` writes the ``__pycache__`` files whatever that
variable says, in a second or two, and then every process reads them; a source file changed later is
seen by its modification time, as usual. A folder that cannot be written is left as it is.
"""
from __future__ import annotations

import compileall
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("src", "tests", "examples", "benchmarks")


def compile_checkout(root: Path = ROOT) -> None:
    """Write the bytecode of every ``.py`` file under ``root``'s code folders (failures are ignored)."""
    for name in FOLDERS:
        if (root / name).is_dir():
            compileall.compile_dir(str(root / name), quiet=2, workers=1)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller compiled before starting it
        return
    compile_checkout()
