"""The environment settings of deepshard's communication, parsed in one place with errors that name the
variable, the value and the fix. Nothing here imports the rest of deepshard, so the process-group
setup (``deepshard.distributed``), the watchdog and the transports all read down to it.

- ``DEEPSHARD_TIMEOUT`` (minutes; DeepSpeed's ``DEEPSPEED_TIMEOUT`` too): every wait's bound and the
  process-group timeout (:func:`timeout_minutes`).
- ``DEEPSHARD_SHM`` (auto, 1, 0): the shared-memory transport between ranks on one host (:func:`mode_from`).
- ``DEEPSHARD_SHM_SLOT_MB``: its outbox slot size (:func:`slot_bytes_from`).
"""
from __future__ import annotations

import platform
from collections.abc import Mapping
from typing import Optional

TIMEOUT_VARS = ("DEEPSHARD_TIMEOUT", "DEEPSPEED_TIMEOUT")
MODE_VAR = "DEEPSHARD_SHM"
SLOT_VAR = "DEEPSHARD_SHM_SLOT_MB"
DEFAULT_SLOT_BYTES = 1 << 20


def positive_setting(key: str, value: str, unit: str, example: str, note: str = "") -> float:
    """``value`` of environment variable ``key`` as a positive number of ``unit``; a clear error otherwise."""
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{key}={value!r} is not a number of {unit}; e.g. {key}={example}") from None
    if not number > 0:
        raise ValueError(f"{key}={value!r} must be a positive number of {unit}{note}")
    return number


def timeout_minutes(environ: Mapping[str, str]) -> tuple[str, float] | None:
    """``(variable, minutes)`` from ``DEEPSHARD_TIMEOUT`` / ``DEEPSPEED_TIMEOUT``, or None when neither is set."""
    if environ.get("DEEPSHARD_WATCHDOG_TIMEOUT", "").strip():
        raise ValueError("DEEPSHARD_WATCHDOG_TIMEOUT is no longer read: DEEPSHARD_TIMEOUT (minutes) bounds every "
                         "wait, collectives and pipeline transfers alike; e.g. DEEPSHARD_TIMEOUT=0.5 for 30 s. "
                         "Unset DEEPSHARD_WATCHDOG_TIMEOUT")
    for key in TIMEOUT_VARS:
        value = environ.get(key, "").strip()
        if value:
            return key, positive_setting(key, value, "minutes", "30", " (0.5 = 30 s)")
    return None


ORDERED_STORES = ("x86_64", "amd64", "i386", "i686")
"""CPUs whose stores become visible to other cores in program order, which the round counters rely on
(Python has no memory fence to issue on a weakly ordered CPU such as ARM)."""


def mode_from(value: Optional[bool], environ: Mapping[str, str], machine: Optional[str] = None) -> Optional[bool]:
    """The transport setting: ``value`` when given, else ``DEEPSHARD_SHM`` (auto/1: used where every rank
    of a gloo group is on one host; 0: never). None means auto. On a CPU outside :data:`ORDERED_STORES`
    auto means TCP and asking for shared memory is an error."""
    raw = environ.get(MODE_VAR, "auto").strip().lower() if value is None else ("1" if value else "0")
    if raw not in ("", "auto", "0", "1"):
        raise ValueError(f"{MODE_VAR}={raw!r}: use auto, 1 (shared memory between ranks on one host) or 0 (TCP)")
    cpu = (machine if machine is not None else platform.machine()).lower()
    if cpu not in ORDERED_STORES:
        if raw == "1":
            raise ValueError(f"{MODE_VAR}=1 (or CommGroup(shm=True)) on a {cpu or 'unknown'} CPU: the shared-memory "
                             "transport relies on x86's in-order stores; unset it (auto keeps TCP here)")
        return False
    return None if raw in ("", "auto") else raw == "1"


def slot_bytes_from(environ: Mapping[str, str]) -> int:
    """The outbox slot size: ``DEEPSHARD_SHM_SLOT_MB`` (MiB, may be fractional) or 1 MiB."""
    raw = environ.get(SLOT_VAR, "").strip()
    if not raw:
        return DEFAULT_SLOT_BYTES
    mib = positive_setting(SLOT_VAR, raw, "MiB", "1")
    return max(4096, int(mib * (1 << 20)) // 4096 * 4096)
