"""Read a config from a dict, a JSON file or a base64 string, and validate it.

JSON files are read strictly: a key repeated in one object is an error (plain ``json`` would keep the
last value silently, so a config could say ``"stage": 3`` twice and mean neither), and a syntax error
is reported with its line and column and the offending line. A config file that is not JSON is read as
Hjson (comments, unquoted keys and strings, optional commas), as DeepSpeed reads its config files, where
the optional ``hjson`` package is installed; without it the JSON error says to install it.
"""
from __future__ import annotations

import base64
import binascii
import copy
import json
import os
import re
from collections.abc import Mapping
from typing import Any, Optional, Union

from pydantic import ValidationError

from deepshard.config.base import ConfigError
from deepshard.config.errors import config_error_from
from deepshard.config.root import DeepShardConfig

ConfigSource = Union[str, "os.PathLike[str]", Mapping, None]

_HOW_TO_PASS = (
    "no DeepSpeed config was given; pass one as deepshard.initialize(..., config=\"ds_config.json\") "
    "(a path, a dict or base64-encoded JSON), or add the command-line flags with "
    "deepshard.add_config_arguments(parser) and run with --deepspeed --deepspeed_config ds_config.json"
)
_B64_CHARS = re.compile(r"^[A-Za-z0-9+/_\-=\s]+$")


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def _key_lines(text: str, key: str) -> list[int]:
    pattern = re.compile(r'"' + re.escape(key) + r'"\s*:')
    return [i for i, line in enumerate(text.splitlines(), start=1) if pattern.search(line)]


def _duplicate_error(text: str, key: str, origin: str) -> ConfigError:
    lines = _key_lines(text, key)
    at = f" (lines {', '.join(map(str, lines))})" if len(lines) > 1 else ""
    return ConfigError(f"duplicate key '{key}' in {origin}{at}: a JSON object may name a key "
                       "only once (otherwise the last value wins silently); remove one of them")


def parse_json_text(text: str, origin: str, hjson_fallback: bool = False) -> dict[str, Any]:
    """Parse JSON text that must be an object; errors name ``origin`` and the line/column.
    ``hjson_fallback``: text that is not JSON is parsed as Hjson (config files, as DeepSpeed does)."""
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as dup:
        raise _duplicate_error(text, dup.key, origin) from None
    except json.JSONDecodeError as err:
        if not hjson_fallback:
            raise ConfigError(_syntax_message(err, origin)) from None
        data = _parse_hjson(text, origin, err)
    if not isinstance(data, dict):
        raise ConfigError(f"{origin} must hold a JSON object ({{...}}), got {type(data).__name__}")
    return data


def _parse_hjson(text: str, origin: str, json_error: json.JSONDecodeError) -> Any:
    """``text`` read as Hjson (a superset of JSON; duplicate keys refused as in JSON), or the JSON error."""
    try:
        import hjson
    except ImportError:
        raise ConfigError(_syntax_message(json_error, origin) + "\n(if the file is Hjson, as DeepSpeed accepts: "
                          "comments, unquoted keys or strings, no commas, install the optional hjson package "
                          "to read it: pip install hjson)") from None
    try:
        return hjson.loads(text, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as dup:
        raise _duplicate_error(text, dup.key, origin) from None
    except hjson.HjsonDecodeError as err:
        raise ConfigError(_syntax_message(json_error, origin) + f"\n(nor is it valid Hjson: {err})") from None


def _syntax_message(err: json.JSONDecodeError, origin: str) -> str:
    lines = err.doc.splitlines()
    msg = f"{origin} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}"
    if 0 < err.lineno <= len(lines):
        line = lines[err.lineno - 1]
        msg += f"\n    {line}\n    {' ' * (err.colno - 1)}^"
        if line.lstrip().startswith(("//", "#")):
            msg += "\n(comments are not allowed in JSON; remove them)"
    return msg


def read_json_file(path: str) -> dict[str, Any]:
    """Read and parse a JSON config file (strict, duplicate keys rejected; Hjson where ``hjson`` is installed)."""
    origin = f"config file '{path}'"
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise ConfigError(f"{origin} does not exist (looked for {os.path.abspath(path)})") from None
    except IsADirectoryError:
        raise ConfigError(f"{origin} is a directory; give the path of the JSON file") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{origin} is not UTF-8 text: {err}") from None
    return parse_json_text(text, origin, hjson_fallback=True)


def _decode_base64(text: str) -> Optional[str]:
    """The decoded text when ``text`` is base64 of UTF-8 JSON-looking text, else None."""
    if not _B64_CHARS.match(text):
        return None
    compact = "".join(text.split())
    try:
        decoded = base64.urlsafe_b64decode(compact + "=" * (-len(compact) % 4)).decode("utf-8")
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None
    return decoded if decoded.lstrip().startswith("{") else None


def _read_string(source: str) -> tuple[dict[str, Any], str]:
    if os.path.isfile(source) or os.path.isdir(source):
        return read_json_file(source), f"config file '{source}'"
    if source.lstrip().startswith("{"):
        return parse_json_text(source, "the config JSON string"), "the config JSON string"
    decoded = None if source.endswith((".json", ".hjson")) else _decode_base64(source)
    if decoded is not None:
        return parse_json_text(decoded, "the base64-encoded config"), "the base64-encoded config"
    shown = source if len(source) <= 120 else source[:117] + "..."
    raise ConfigError(
        f"config file '{shown}' does not exist (looked for {os.path.abspath(source)}), and the string is "
        "not base64-encoded JSON either; give the path of a JSON file, a dict, or base64 of JSON")


def read_config_source(source: ConfigSource) -> tuple[dict[str, Any], Optional[str]]:
    """The config dict (a private copy) and a description of where it came from (None for dicts)."""
    if source is None:
        raise ConfigError(_HOW_TO_PASS)
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source)), None
    if isinstance(source, os.PathLike):
        path = os.fspath(source)
        return read_json_file(path), f"config file '{path}'"
    if isinstance(source, str):
        return _read_string(source)
    raise ConfigError(f"a config must be a path, a dict or a base64 string, got {type(source).__name__}")


def load_config(source: ConfigSource, dp_world_size: int) -> DeepShardConfig:
    """Read and validate a DeepSpeed-schema config.

    ``source`` is a dict (deep-copied, never mutated), a path to a JSON file, or base64-encoded JSON
    (as DeepSpeed accepts). ``dp_world_size`` is the data-parallel size used for the batch-size
    arithmetic. Raises :class:`ConfigError` naming the key, the value and the fix.
    """
    if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
        raise ConfigError(f"dp_world_size must be an int >= 1, got {dp_world_size!r}")
    data, origin = read_config_source(source)
    try:
        return DeepShardConfig.model_validate(data, context={"dp_world_size": dp_world_size})
    except ValidationError as exc:
        raise config_error_from(exc, DeepShardConfig, origin) from None
