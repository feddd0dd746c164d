"""Shapes of the checkpoint's JSON files, checked when they are read.

A file that parses as JSON can still hold the wrong thing (an edited value, a file from another
checkpoint, a truncated rewrite); reading it blindly fails far away with ``KeyError: 'state'`` or
``AttributeError: 'list' object has no attribute 'get'``, naming no file. :func:`check` compares what was
read with a small schema and raises :class:`CheckpointError` naming the file, the key and what was found.

A schema is a type (``int``, ``str``, ``dict``, ``list``, ``object`` for anything), a :class:`ListOf`, or a
dict of key -> schema (an :class:`Optional` key may be absent). Extra keys are allowed (newer writers).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepshard.checkpoint.io import CheckpointError


@dataclass(frozen=True)
class Optional:
    """A key that may be absent."""

    schema: Any


@dataclass(frozen=True)
class ListOf:
    """A list whose items all match ``schema``."""

    schema: Any


_NAMES = {int: "an integer", str: "a string", dict: "a mapping", list: "a list", float: "a number",
          bool: "true or false"}


def _mismatch(value: Any, schema: Any, where: str) -> str | None:
    """Where ``value`` first differs from ``schema`` (a path and what was found), or None."""
    if schema is object:
        return None
    if isinstance(schema, Optional):
        return _mismatch(value, schema.schema, where)
    if isinstance(schema, ListOf):
        if not isinstance(value, list):
            return f"{where or 'the file'} should be a list, found {_show(value)}"
        for i, item in enumerate(value):
            found = _mismatch(item, schema.schema, f"{where}[{i}]")
            if found:
                return found
        return None
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return f"{where or 'the file'} should be a mapping, found {_show(value)}"
        for key, sub in schema.items():
            path = f"{where}.{key}" if where else key
            if key not in value:
                if isinstance(sub, Optional):
                    continue
                return f"'{path}' is missing"
            found = _mismatch(value[key], sub, path)
            if found:
                return found
        return None
    ok = isinstance(value, schema) and not (schema in (int, float) and isinstance(value, bool))
    if schema is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return None if ok else f"'{where}' should be {_NAMES.get(schema, schema.__name__)}, found {_show(value)}"


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def check(path: Path, value: Any, schema: Any, what: str) -> Any:
    """``value`` (read from ``path``) when it matches ``schema``; else :class:`CheckpointError` naming the
    file, ``what`` it should be and the first difference."""
    found = _mismatch(value, schema, "")
    if found:
        raise CheckpointError(f"{path} is not a valid {what}: {found}. The file was edited, truncated or comes "
                              "from elsewhere; load another tag or save the checkpoint again")
    return value


ENGINE = {"format": str, "global_steps": int, "global_samples": int, "micro_steps": Optional(int),
          "skipped_steps": int, "loss_scaler": dict, "zero_stage": Optional(int), "dp_world_size": Optional(int),
          "grid": Optional({"pp": int, "dp": int, "tp": int}), "state": object}
"""``engine.json``: counters, loss scaler and the skeleton of the engine's tensors file."""

RANK = {"rank": int, "tensors": Optional(str), "fragments": list, "scalars": Optional(dict), "shapes": dict,
        "aliases": Optional(dict), "meta": Optional(dict), "splits": Optional(dict), "coord": Optional(dict),
        "param_groups": Optional(ListOf(dict)), "extra": Optional({"file": str})}
"""``zero_rank<N>.json``: which slices of which parameters the rank's tensors file holds (and, for the rank
that wrote its slice's buffers and frozen weights, that file's name)."""



def check_rank_info(path: Path, info: Any, rank: int) -> dict[str, Any]:
    """A ``zero_rank<N>.json`` (``rank`` = N, from its name): its schema, its fragments' items, and that
    it says it is rank N's (files of two ranks swapped or renamed)."""
    check(path, info, RANK, "rank file (zero_rank<N>.json)")
    for i, frag in enumerate(info["fragments"]):
        if not (isinstance(frag, list) and len(frag) == 3 and isinstance(frag[0], str)
                and all(isinstance(x, int) and not isinstance(x, bool) for x in frag[1:])):
            raise CheckpointError(f"{path} is not a valid rank file (zero_rank<N>.json): 'fragments[{i}]' should "
                                  f"be [name, start, count], found {_show(frag)}; load another tag")
    if info["rank"] != rank:
        raise CheckpointError(f"{path} holds rank {info['rank']}'s fragments, not rank {rank}'s: files of the "
                              "checkpoint were swapped or renamed; restore the original names or load another tag")
    return info
