"""What a process reads and writes of a checkpoint, and the verifier its reads go through.

Two context-scoped hooks, no process-wide state: they live in ``contextvars`` and are active only inside
a ``with`` block of the code that asked for them.

* :func:`track_io` counts the files and bytes ``checkpoint/io.py`` reads and writes inside the block
  (tests, ``deepshard dryrun`` and ``benchmarks/scale.py`` use it to show what one rank touches).
* :func:`verifying` makes every read of a file under one checkpoint directory go through a
  :class:`Verifier` (``checkpoint/verify.py``: the file's size and sha256 against ``manifest.json``, the
  hash taken while the bytes are read). ``load_checkpoint`` opens one around its reads, so each rank
  verifies exactly the files it loads and never hashes another rank's.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Protocol


@dataclass
class IOLedger:
    """Checkpoint files read and written inside a :func:`track_io` block: ``path -> bytes``."""

    read: dict[str, int] = field(default_factory=dict)
    written: dict[str, int] = field(default_factory=dict)

    @property
    def files_read(self) -> int:
        return len(self.read)

    @property
    def bytes_read(self) -> int:
        return sum(self.read.values())

    @property
    def files_written(self) -> int:
        return len(self.written)

    @property
    def bytes_written(self) -> int:
        return sum(self.written.values())

    def names_read(self) -> list[str]:
        """The base names of the files read, sorted (what a test compares)."""
        return sorted(Path(p).name for p in self.read)

    def summary(self) -> dict[str, int]:
        return {"files_read": self.files_read, "bytes_read": self.bytes_read,
                "files_written": self.files_written, "bytes_written": self.bytes_written}


class Verifier(Protocol):
    """Reads a checkpoint file whole, checking it against a record of its size and digest."""

    directory: Path

    def read(self, path: Path) -> bytes:
        """The file's bytes, once its size and sha256 match the record (else a ``CheckpointError``)."""
        ...


_LEDGERS: ContextVar[tuple[IOLedger, ...]] = ContextVar("deepshard_checkpoint_ledgers", default=())
_VERIFIERS: ContextVar[tuple[Verifier, ...]] = ContextVar("deepshard_checkpoint_verifiers", default=())


@contextlib.contextmanager
def track_io() -> Iterator[IOLedger]:
    """Count the checkpoint files and bytes read and written inside the block (nested blocks each count)."""
    ledger = IOLedger()
    token = _LEDGERS.set(_LEDGERS.get() + (ledger,))
    try:
        yield ledger
    finally:
        _LEDGERS.reset(token)


def note_read(path: Path | str, nbytes: int) -> None:
    for ledger in _LEDGERS.get():
        key = str(path)
        ledger.read[key] = ledger.read.get(key, 0) + int(nbytes)


def note_write(path: Path | str, nbytes: int) -> None:
    for ledger in _LEDGERS.get():
        ledger.written[str(path)] = int(nbytes)


@contextlib.contextmanager
def verifying(verifier: Verifier) -> Iterator[Verifier]:
    """Inside the block, files under ``verifier.directory`` are read through ``verifier``."""
    token = _VERIFIERS.set(_VERIFIERS.get() + (verifier,))
    try:
        yield verifier
    finally:
        _VERIFIERS.reset(token)


def verifier_for(path: Path) -> Optional[Verifier]:
    """The innermost active verifier whose directory holds ``path`` (None: read it unverified)."""
    parent = Path(path).parent
    for verifier in reversed(_VERIFIERS.get()):
        if parent == verifier.directory or verifier.directory in parent.parents:
            return verifier
    return None
