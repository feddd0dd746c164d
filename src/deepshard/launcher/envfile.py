"""The environment a multi-node job carries to every node: an env file plus well-known prefixes."""
from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

# Variables whose names start with these travel to every node.
EXPORT_PREFIXES: tuple[str, ...] = ("PYTHON", "NCCL", "MLFLOW", "UCX", "MV2", "OMP", "CUDA", "TORCH",
                                    "DEEPSHARD", "GLOO")

# Per-machine or per-launch variables never copied from the launcher to other nodes.
NOT_EXPORTED: frozenset[str] = frozenset({"CUDA_VISIBLE_DEVICES", "DEEPSHARD_RESTART_COUNT"})

ENV_FILE_NAMES: tuple[str, ...] = (".deepspeed_env", ".deepshard_env")

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_env_file(text: str, source: str = "env file") -> dict[str, str]:
    """``NAME=VALUE`` lines as a dict (last value wins; one pair of quotes stripped); a bad line raises
    ``ValueError`` naming ``source`` and the line number."""
    result: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].strip()
        name, sep, value = line.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not _NAME.match(name):
            raise ValueError(f"{source}:{lineno}: cannot parse {raw.strip()!r}; each line must read "
                             "NAME=VALUE with NAME made of letters, digits and '_' (e.g. NCCL_DEBUG=INFO)")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        result[name] = value
    return result


def env_file_paths(environ: Mapping[str, str], home: str, cwd: str) -> list[str]:
    """The env files to read, in order (later ones win); only names, existence is not checked."""
    custom = environ.get("DEEPSHARD_ENV_FILE") or environ.get("DS_ENV_FILE")
    names: Sequence[str] = (custom,) if custom else ENV_FILE_NAMES
    paths: list[str] = []
    for directory in (home, cwd):
        for name in names:
            path = os.path.join(directory, name)  # an absolute name stays as it is
            if path not in paths:
                paths.append(path)
    return paths


def read_env_files(paths: Sequence[str]) -> dict[str, str]:
    merged: dict[str, str] = {}
    for path in paths:
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as handle:
                merged.update(parse_env_file(handle.read(), source=path))
    return merged


def prefixed_variables(environ: Mapping[str, str],
                       prefixes: Sequence[str] = EXPORT_PREFIXES) -> dict[str, str]:
    """The variables of ``environ`` whose names start with one of ``prefixes`` (sorted by name),
    without :data:`NOT_EXPORTED`."""
    return {name: environ[name] for name in sorted(environ)
            if name.startswith(tuple(prefixes)) and name not in NOT_EXPORTED}


def job_exports(environ: Mapping[str, str], home: str | None = None, cwd: str | None = None) -> dict[str, str]:
    """Everything to export to every node: the prefixed variables, then the env files' variables."""
    home = home if home is not None else os.path.expanduser("~")
    cwd = cwd if cwd is not None else os.getcwd()
    exports = prefixed_variables(environ)
    exports.update(read_env_files(env_file_paths(environ, home, cwd)))
    return exports
