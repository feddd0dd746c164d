"""Turn pydantic's ValidationError into one readable :class:`ConfigError`.

Each problem becomes one sentence with the full key path: an unknown key gets the closest valid key
of its section (``unknown config key 'zero_optimization.stgae'; did you mean 'stage'?``), a bad value
gets the value, its type and what was expected.
"""
from __future__ import annotations

import difflib
import typing
from typing import Any, Optional, Sequence

from pydantic import BaseModel, ValidationError

from deepshard.config.base import EXACT_ERROR_TYPE, ConfigError

_MAX_LISTED_KEYS = 20


def format_path(loc: Sequence[Any]) -> str:
    """``("comms_logger", "prof_ops", 0)`` -> ``comms_logger.prof_ops[0]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _model_in(annotation: Any) -> Optional[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def section_at(root: type[BaseModel], keys: Sequence[Any]) -> Optional[type[BaseModel]]:
    """The section model reached by following input keys (names or aliases) from ``root``."""
    model: Optional[type[BaseModel]] = root
    for key in keys:
        if model is None or not isinstance(key, str):
            return None
        field = next((f for name, f in model.model_fields.items() if key in (name, f.alias)), None)
        model = _model_in(field.annotation) if field is not None else None
    return model


def valid_keys(model: type[BaseModel]) -> list[str]:
    """Field names and their aliases, sorted."""
    keys = set(model.model_fields)
    keys.update(f.alias for f in model.model_fields.values() if f.alias)
    return sorted(keys)


def _unknown_key(loc: Sequence[Any], root: type[BaseModel]) -> str:
    path = format_path(loc)
    msg = f"unknown config key '{path}'"
    section = section_at(root, loc[:-1])
    if section is None or not isinstance(loc[-1], str):
        return msg
    keys = valid_keys(section)
    close = difflib.get_close_matches(loc[-1], keys, n=1, cutoff=0.6)
    if close:
        return f"{msg}; did you mean '{close[0]}'?"
    where = format_path(loc[:-1]) or "the top level"
    if len(keys) <= _MAX_LISTED_KEYS:
        return f"{msg}; valid keys in {where}: {', '.join(keys)}"
    return f"{msg}; it is not one of the {len(keys)} keys {where} accepts"


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_error(error: dict[str, Any], root: type[BaseModel]) -> str:
    """One pydantic error dict as a sentence naming the key path."""
    kind, loc, msg = error["type"], tuple(error["loc"]), error["msg"]
    path = format_path(loc)
    if kind == EXACT_ERROR_TYPE:
        return msg
    if kind == "extra_forbidden":
        return _unknown_key(loc, root)
    if kind == "missing":
        return f"config key '{path}' is required but missing"
    if kind == "model_type":
        msg = "expected a JSON object ({...}) holding this section's keys"
    if kind in ("value_error", "assertion_error"):
        msg = msg.split(", ", 1)[1] if msg.startswith(("Value error, ", "Assertion failed, ")) else msg
        if not loc:
            return msg
    value = error.get("input")
    if isinstance(value, dict):
        return f"config key '{path}' is invalid: {msg}"
    return f"config key '{path}' = {_short(value)} ({type(value).__name__}) is invalid: {msg}"


def config_error_from(exc: ValidationError, root: type[BaseModel],
                      origin: Optional[str] = None) -> ConfigError:
    """A :class:`ConfigError` listing every problem in ``exc``; ``origin`` names the file, if any."""
    lines = list(dict.fromkeys(describe_error(err, root) for err in exc.errors()))
    if len(lines) == 1:
        text = f"{lines[0]} ({origin})" if origin else lines[0]
    else:
        where = f" in {origin}" if origin else ""
        text = f"{len(lines)} problems in the config{where}:\n" + "\n".join(f"  - {line}" for line in lines)
    return ConfigError(text)
