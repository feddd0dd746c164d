"""Swap directories that outlive their process are reclaimed by the next one.

A process that ends normally removes its swap files (``AsyncSwapper.close`` / ``weakref.finalize``), but
one that is killed (SIGKILL, a crash in native code, the launcher's stop after a failure, every
``--max_restarts`` attempt) cannot, and ZeRO-Infinity's files take 12-16 bytes per parameter: a disk
fills after one or two failures. So each swap directory holds a lock file that its owner keeps locked
(``flock``) for its lifetime; the kernel drops the lock however the owner ends. A new swapper first
takes every unlocked ``deepshard-*`` directory under its ``nvme_path`` and deletes it: those owners are
gone. A directory whose lock is held (a live run sharing the path) is left alone.

A SIGTERM (the launcher stopping a job) is turned into ``SystemExit`` when nothing else handles it, so
a rank that is stopped between collectives unwinds and removes its files itself.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

from deepshard.utils.logging import logger

LOCK_NAME = ".owner.lock"
PREFIX = "deepshard-"
SETTLE_S = 10.0


def hold_lock(directory: Path) -> int:
    """Create and lock ``directory``'s lock file; the returned descriptor keeps the lock until closed."""
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _owner_gone(directory: Path) -> bool:
    """True when nobody holds ``directory``'s lock. A directory without a lock file, or whose lock file
    is younger than :data:`SETTLE_S` (its owner may be between creating and locking it), is kept."""
    lock = directory / LOCK_NAME
    try:
        if time.time() - lock.stat().st_mtime < SETTLE_S:
            return False
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return False  # being created right now by another process, or not ours
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # a live owner holds it
    finally:
        os.close(fd)
    return True


def reclaim_stale(root: Path) -> list[Path]:
    """Delete the swap directories under ``root`` whose owner process is gone; return them."""
    reclaimed = []
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return reclaimed
    for entry in entries:
        if entry.name.startswith(PREFIX) and entry.is_dir() and _owner_gone(entry):
            size = sum(p.stat().st_size for p in entry.iterdir() if p.is_file())
            shutil.rmtree(entry, ignore_errors=True)
            reclaimed.append(entry)
            logger.warning("reclaimed %s (%d bytes): swap files of a process that ended without removing "
                           "them (killed or crashed)", entry, size)
    return reclaimed


def exit_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit(143)`` when it still has its default action (main thread only), so
    finalizers run and swap files are removed; a handler the program installed is left as it is."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _raise_exit)
    except (ValueError, OSError):
        pass


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
