"""Top-level keys DeepSpeed ignores and the ecosystem sends: dropped with one warning line.

DeepSpeed 0.19.8 reads each top-level key it knows and never looks at the others, so two kinds of key
pass through it silently, and libraries built on it send both:

- *dotted* keys such as ``"zero_optimization.reduce_bucket_size"`` (TRL's ``prepare_deepspeed`` adds
  three of them to its reference model's config). DeepSpeed does not read them as nested settings:
  the reference model trains with the section's own values. deepshard matches that: they are ignored.
- keys of no section at all (a tool's own bookkeeping).

Both are removed before validation and named in one warning. A key that is *close* to a real one
(``"optimiser"``) is not among them: it is almost certainly a typo whose setting would silently be lost,
and stays an error naming the key it resembles. Unknown keys *inside* a section are errors too, as they
are in DeepSpeed.
"""
from __future__ import annotations

import difflib
from typing import Any, Iterable

from deepshard.utils.logging import logger

CLOSE_MATCH_CUTOFF = 0.6
"""How similar an unknown key must be to a known one to be read as its typo (``difflib`` ratio; the
same cutoff the unknown-key error uses for its suggestion)."""


def is_typo(key: str, known: Iterable[str]) -> bool:
    """Whether ``key`` is close enough to a known key to be a misspelling of it."""
    return bool(difflib.get_close_matches(key, list(known), n=1, cutoff=CLOSE_MATCH_CUTOFF))


def tolerated_keys(data: dict[str, Any], known: set[str]) -> list[str]:
    """The top-level keys of ``data`` to drop: dotted ones, and unknown ones that resemble no known key."""
    out = []
    for key in data:
        if not isinstance(key, str) or key in known:
            continue
        if "." in key or not is_typo(key, known):
            out.append(key)
    return out


def drop_tolerated_keys(data: dict[str, Any], known: set[str]) -> dict[str, Any]:
    """``data`` without :func:`tolerated_keys`, after one warning line naming them (``data`` is a fresh
    copy the caller owns; it is changed in place and returned)."""
    dropped = tolerated_keys(data, known)
    if not dropped:
        return data
    dotted = [k for k in dropped if "." in k]
    other = [k for k in dropped if "." not in k]
    parts = []
    if dotted:
        first = dotted[0]
        section, _, sub = first.partition(".")
        parts.append(f"dotted top-level key(s) {', '.join(repr(k) for k in dotted)} are not read as nested "
                     f"settings (to set one, nest it: {{\"{section}\": {{\"{sub}\": ...}}}})")
    if other:
        parts.append(f"unknown top-level key(s) {', '.join(repr(k) for k in other)} belong to no config section")
    logger.warning("config: ignoring keys DeepSpeed ignores too: %s", "; ".join(parts))
    for key in dropped:
        del data[key]
    return data
