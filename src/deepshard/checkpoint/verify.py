"""Checking a checkpoint's files against its ``manifest.json``: per rank while loading, or all of them on
request (``deepshard verify CKPT``).

``load_checkpoint`` reads the manifest once and opens a :class:`ManifestVerifier` around its reads
(``ledger.verifying``): a file is read whole into memory, its sha256 computed from the same bytes, and
only then parsed. So each rank verifies exactly the files it loads, and nobody hashes the files of
another rank (at N ranks the old full check read N x the checkpoint). The full check of every file,
:func:`deepshard.checkpoint.io.verify_manifest`, stays one command away.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from deepshard.checkpoint import io as ckpt_io
from deepshard.checkpoint import ledger

_CHUNK = 8 * 1024 * 1024


class ManifestVerifier:
    """One checkpoint directory's manifest, read once; :meth:`read` returns a file's bytes once they match it."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.files: dict[str, dict[str, Any]] = ckpt_io._read_manifest(self.directory)
        self.verified: set[str] = set()

    def names(self) -> list[str]:
        """Every file the manifest records, sorted (names relative to the directory)."""
        return sorted(self.files)

    def read(self, path: Path) -> bytearray:
        """The bytes of ``path`` (under :attr:`directory`), hashed as they are read; a ``CheckpointError``
        naming the file when it is not recorded, has another size, or another digest."""
        path = Path(path)
        name = path.relative_to(self.directory).as_posix()
        entry = self.files.get(name)
        if entry is None:
            raise ckpt_io._damaged(self.directory, f"{name} is not recorded in {ckpt_io.MANIFEST_NAME} (a file "
                                                   "of another save, or the manifest was replaced)")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise ckpt_io._damaged(self.directory, f"{name} is truncated or altered ({size} bytes on disk, "
                                                   f"{entry['bytes']} bytes recorded in {ckpt_io.MANIFEST_NAME})")
        data, digest = _read_hashing(path, size)
        ledger.note_read(path, len(data))
        if len(data) != size or digest != entry["sha256"]:
            raise ckpt_io._damaged(self.directory, f"{name} is corrupted (sha256 {digest[:16]}... differs from "
                                                   f"{entry['sha256'][:16]}... in {ckpt_io.MANIFEST_NAME})")
        self.verified.add(name)
        return data


def _read_hashing(path: Path, size: int) -> tuple[bytearray, str]:
    """The file's bytes in one buffer and their sha256, from one pass over the file."""
    data = bytearray(size)
    view = memoryview(data)
    digest = hashlib.sha256()
    done = 0
    with open(path, "rb", buffering=0) as f:
        while done < size:
            n = f.readinto(view[done:done + _CHUNK])
            if not n:
                break
            digest.update(view[done:done + n])
            done += n
    return (data if done == size else data[:done]), digest.hexdigest()


def tag_directory(path: Path, tag: Optional[str] = None) -> Path:
    """The tag directory ``path`` names: itself when it holds a manifest, else ``path/tag`` or the tag in
    ``path/latest``."""
    path = Path(path)
    if tag is None and (path / ckpt_io.MANIFEST_NAME).is_file():
        return path
    tag = tag if tag is not None else ckpt_io.read_latest(path)
    if tag is None:
        raise ckpt_io.CheckpointError(f"{path} has no {ckpt_io.MANIFEST_NAME} and no '{ckpt_io.LATEST_NAME}' file: "
                                      "pass a checkpoint tag directory, or the save directory with --tag")
    return path / tag


def main(argv: Sequence[str] | None = None, prog: str = "deepshard verify") -> int:
    """``deepshard verify CKPT [--tag T]``: check the size and sha256 of every file of a checkpoint."""
    parser = argparse.ArgumentParser(prog=prog, description=(
        "Check every file of a deepshard checkpoint against its manifest (sizes first, then sha256). "
        "load_checkpoint checks only the files each rank loads; this checks them all."))
    parser.add_argument("checkpoint", help="a tag directory (holding manifest.json) or the save directory")
    parser.add_argument("--tag", default=None, help="the tag inside the save directory (default: its 'latest')")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        directory = tag_directory(Path(args.checkpoint), args.tag)
        with ledger.track_io() as io:
            names = ckpt_io.verify_manifest(directory)
    except ckpt_io.CheckpointError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 1
    print(f"{directory}: {len(names)} files, {io.bytes_read:,} bytes: sizes and sha256 match {ckpt_io.MANIFEST_NAME}")
    return 0
