"""Fixtures shared by the unit tests."""
from __future__ import annotations

import sys
from typing import Iterator

import pytest

import deepshard.compat as compat


@pytest.fixture()
def shim() -> Iterator[None]:
    """``import deepspeed`` answered by deepshard for the test (a real or earlier ``deepspeed`` module is put
    back afterwards)."""
    compat.uninstall()
    saved = sys.modules.pop("deepspeed", None)
    compat.install(replace_installed=True)
    yield
    compat.uninstall()
    if saved is not None:
        sys.modules["deepspeed"] = saved
