"""The license the README and pyproject name is the one in the repository, and pyproject ships its text.

(The wheel itself was checked by hand: ``pip wheel . --no-deps`` holds ``deepshard-*.dist-info/licenses/LICENSE``
and ``License-Expression: Apache-2.0``; building one here would need the package index.)
"""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_license_file_is_the_apache_2_text_pyproject_ships() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 150  # the full text, not a stub
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert "License: Apache-2.0" in (ROOT / "README.md").read_text(encoding="utf-8")
