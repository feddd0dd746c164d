"""Resolve a dotted ``deepspeed`` name the way client code reaches it: the longest importable module
prefix is imported (``import deepspeed.a.b``), the rest read as attributes; a ``get_accelerator()``
segment is called (``get_accelerator().device_name``)."""
from __future__ import annotations

import importlib
from typing import Any


def _import_longest(parts: list[str]) -> tuple[Any, list[str]]:
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            return importlib.import_module(module_name), parts[cut:]
        except ModuleNotFoundError as exc:
            if exc.name is None or not (module_name + ".").startswith(exc.name + "."):
                raise  # a module this one imports is missing, not this one
    raise ModuleNotFoundError(f"no module on the path of {'.'.join(parts)!r}")


def _walk(value: Any, attrs: list[str]) -> Any:
    for attr in attrs:
        value = getattr(value, attr)
    return value


def resolve(name: str) -> Any:
    """The object client code gets for ``name``; raises what it would raise."""
    head, *calls = name.split("().")
    value, rest = _import_longest(head.split("."))
    value = _walk(value, rest)
    for segment in calls:
        value = _walk(value(), segment.split("."))
    return value
