"""The checkpoint file layer: safetensors for tensors, JSON for metadata, atomic publication.

Nothing here knows about engines, ranks or ZeRO; the engine calls these functions. The rules:

* Tensors go to safetensors files, everything else to JSON. Loading never unpickles, so opening a
  checkpoint from an untrusted source cannot run code.
* Every file is written under a temporary name in its final directory, fsynced, then renamed over the
  final name (``os.replace``), so a crash leaves either the old file or the new one, never half of one.
* A whole checkpoint is written into a staging directory ``save_dir/.tmp-<tag>`` and published by
  :func:`commit_staging`. ``manifest.json`` records the size and sha256 of every file so that
  :func:`verify_manifest` can tell a truncated or corrupted checkpoint from a good one.

Multi-rank protocol (run by the engine): rank 0 calls :func:`staging_dir`, barrier, every rank writes
its own files into it, barrier, rank 0 calls :func:`write_manifest` with the list of all files, then
:func:`commit_staging` and :func:`write_latest`.

Crash safety of :func:`commit_staging`: publishing a directory over an existing one cannot be a single
rename on POSIX, so the old checkpoint is first renamed aside to ``save_dir/.old-<tag>-<n>``. A crash
between the two renames leaves ``<tag>`` absent and the old checkpoint whole under the aside name;
:func:`recover_tag` (or ``mv save_dir/.old-<tag>-<n> save_dir/<tag>`` by hand) puts it back.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from deepshard.checkpoint.ledger import note_read, note_write, verifier_for
from deepshard.utils.progress import progress

__all__ = [
    "CheckpointError", "CheckpointWriteError", "free_bytes", "save_tensors", "load_tensors", "save_json", "load_json", "file_digest",
    "file_entry",
    "write_manifest", "verify_manifest", "staging_dir", "commit_staging", "recover_tag",
    "repair_save_dir", "write_latest", "read_latest", "validate_tag", "MANIFEST_NAME", "LATEST_NAME",
]

MANIFEST_NAME = "manifest.json"
NAME_KEY = "deepshard_file"
"""The safetensors metadata key recording the name a checkpoint file was written under."""
LATEST_NAME = "latest"
MANIFEST_FORMAT = "deepshard-checkpoint"
MANIFEST_VERSION = 1
_CHUNK = 8 * 1024 * 1024
_MAX_TAG_LEN = 200


class CheckpointError(RuntimeError):
    """A checkpoint (or one of its files) is missing, truncated, corrupted or malformed."""


class CheckpointWriteError(CheckpointError, OSError):
    """A checkpoint file could not be written (disk full, no permission, ...); names the file, the
    directory, the bytes needed and the bytes free."""


# --------------------------------------------------------------------------------------------------
# atomic writes
# --------------------------------------------------------------------------------------------------

def _fsync_dir(directory: Path) -> None:
    """Make a rename or a new directory entry durable (best effort where directories can't be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged process may still write on the file system holding ``directory``."""
    return shutil.disk_usage(directory).free


def _write_failure(path: Path, needed: int, err: BaseException) -> CheckpointWriteError:
    """The error for a file that could not be written: the file, its directory, bytes needed and free."""
    directory = path.parent
    try:
        free = f"{free_bytes(directory):,} bytes free"
    except OSError:
        free = "free space unknown"
    reason = getattr(err, "strerror", None) or str(err)
    if getattr(err, "errno", None) == errno.EACCES or isinstance(err, PermissionError):
        fix = f"make {directory} writable by this user or save to another directory"
    else:
        fix = f"free at least {needed:,} bytes on that file system or save to another directory"
    return CheckpointWriteError(
        f"cannot write {path.name} in {directory}: {reason} (the file needs {needed:,} bytes; "
        f"{free} there); {fix}")


def _atomic_write(path: Path, write: Callable[[Path], None], needed: int = 0) -> None:
    """Call ``write(tmp)`` on a temporary name next to ``path``, fsync it, then rename it to ``path``.

    ``needed`` is the file's size (about); a file system with less free space is refused before a byte is
    written, and any OS error while writing becomes a :class:`CheckpointWriteError` naming the file, its
    directory and the bytes needed and free.
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if free_bytes(path.parent) < needed:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        write(tmp)
        _fsync_file(tmp)
        written = tmp.stat().st_size
        os.replace(tmp, path)
    except BaseException as err:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(err, OSError) or "No space left" in str(err):
            raise _write_failure(path, needed, err) from err
        raise
    _fsync_dir(path.parent)
    note_write(path, written)


def _write_bytes_atomic(path: Path, data: bytes) -> None:
    _atomic_write(path, lambda tmp: tmp.write_bytes(data), len(data))


# --------------------------------------------------------------------------------------------------
# tensors
# --------------------------------------------------------------------------------------------------

def _prepare_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detach, move to CPU, make contiguous, and clone any tensor whose storage another one uses."""
    seen_storages: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if not isinstance(key, str):
            raise TypeError(f"tensor names must be str, got {key!r} ({type(key).__name__})")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensors[{key!r}] is a {type(tensor).__name__}, not a torch.Tensor; "
                            "put non-tensor values in the JSON metadata instead")
        if tensor.layout != torch.strided or tensor.is_meta:
            raise TypeError(f"tensors[{key!r}] has layout {tensor.layout} on device {tensor.device}; "
                            "only dense tensors with data can be saved (call .to_dense() or "
                            "materialize it first)")
        t = tensor.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if storage.nbytes() > 0:
            ptr = storage.data_ptr()
            if ptr in seen_storages:
                t = t.clone()
            else:
                seen_storages.add(ptr)
        out[key] = t
    return out


def save_tensors(path: Path, tensors: dict[str, torch.Tensor],
                 metadata: dict[str, str] | None = None, record_name: bool = True) -> None:
    """Write ``tensors`` to a safetensors file at ``path`` atomically.

    Tensors are detached, moved to CPU and made contiguous; tensors that share storage (views of one
    another, tied weights) are cloned, because safetensors refuses shared storage. ``metadata`` is
    the safetensors header's string-to-string map; with ``record_name`` (checkpoint files; not files
    exported for other tools) the file's own name is recorded there too (:data:`NAME_KEY`), so a file
    renamed or swapped with another is recognised on load.
    """
    from safetensors.torch import save_file

    if metadata is not None:
        bad = {k: v for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)}
        if bad:
            raise TypeError(f"safetensors metadata must map str to str; offending entries: {bad!r}; "
                            "convert the values with str() or json.dumps()")
    if record_name:
        metadata = {**(metadata or {}), NAME_KEY: Path(path).name}
    prepared = _prepare_tensors(tensors)
    header = 8 + 128 * (len(prepared) + 1) + sum(len(k) for k in prepared)  # an over-estimate
    header += sum(len(k) + len(v) + 8 for k, v in (metadata or {}).items())
    needed = header + sum(t.numel() * t.element_size() for t in prepared.values())
    _atomic_write(Path(path), lambda tmp: save_file(prepared, str(tmp), metadata=metadata), needed)


def load_tensors(path: Path, device: str | torch.device = "cpu", names: Optional[set[str]] = None
                 ) -> dict[str, torch.Tensor]:
    """Read every tensor of a safetensors file onto ``device`` (with ``names``: only those); never unpickles.

    Inside ``load_checkpoint`` (a :func:`deepshard.checkpoint.ledger.verifying` block) the whole file is
    read once, its size and sha256 checked against the manifest as it is read, and the tensors taken from
    those bytes. Otherwise the file is memory-mapped and only the wanted tensors are read.

    Raises :class:`CheckpointError` naming the file if it is missing, truncated, has a corrupt header,
    or was written under another name (files of a checkpoint swapped or renamed).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} does not exist; the checkpoint is incomplete "
                              "or the path/tag is wrong (check the directory and its 'latest' file)")
    verifier = verifier_for(path)
    if verifier is not None:
        return _tensors_from_bytes(path, verifier.read(path), device, names)
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            _check_written_name(path, f.metadata())
            out = {key: f.get_tensor(key) for key in f.keys() if names is None or key in names}
    except (SafetensorError, OSError, ValueError) as err:
        raise _unreadable(path, err) from err
    size = path.stat().st_size
    note_read(path, size if names is None else min(size, sum(t.nbytes for t in out.values())))
    return out


def _tensors_from_bytes(path: Path, data: bytearray, device: str | torch.device, names: Optional[set[str]]
                        ) -> dict[str, torch.Tensor]:
    from deepshard.checkpoint.safetensors_bytes import parse

    try:
        tensors, metadata = parse(data, names)
    except ValueError as err:
        raise _unreadable(path, err) from err
    _check_written_name(path, metadata)
    if str(device) != "cpu":
        tensors = {k: v.to(device) for k, v in tensors.items()}
    return tensors


def _check_written_name(path: Path, metadata: Optional[dict[str, str]]) -> None:
    written_as = (metadata or {}).get(NAME_KEY)
    if written_as is not None and written_as != path.name:
        raise CheckpointError(f"{path} holds the tensors written as {written_as}: files of the checkpoint "
                              "were swapped or renamed; restore their names or load another tag")


def _unreadable(path: Path, err: BaseException) -> CheckpointError:
    size = path.stat().st_size
    return CheckpointError(
        f"cannot read tensors from {path} ({size} bytes): {err}. The file is truncated or "
        "corrupted; run `deepshard verify` on its checkpoint directory to confirm, and load "
        "another tag")


# --------------------------------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------------------------------

def save_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON with sorted keys, atomically. NaN/inf are refused (strict JSON)."""
    try:
        text = json.dumps(obj, indent=2, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise TypeError(f"cannot write {path} as JSON: {err}; pass the object through "
                        "deepshard.checkpoint.flatten_state() first") from err
    _write_bytes_atomic(Path(path), (text + "\n").encode("utf-8"))


def load_json(path: Path) -> Any:
    """Read a JSON file; :class:`CheckpointError` naming the file if it is missing or invalid."""
    path = Path(path)
    try:
        verifier = verifier_for(path)
        if verifier is not None:
            if not path.is_file():
                raise FileNotFoundError(path)
            text = bytes(verifier.read(path)).decode("utf-8")
        else:
            text = path.read_text(encoding="utf-8")
            note_read(path, len(text))
    except FileNotFoundError as err:
        raise CheckpointError(f"checkpoint file {path} does not exist; the checkpoint is incomplete "
                              "or the path/tag is wrong") from err
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path} is not UTF-8 text ({err}); the file is corrupted, load "
                              "another tag") from err
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: "
                              f"{err.msg}); the file is truncated or corrupted, load another "
                              "tag") from err


# --------------------------------------------------------------------------------------------------
# manifest
# --------------------------------------------------------------------------------------------------

def file_digest(path: Path) -> str:
    """sha256 hex digest of a file, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    note_read(path, size)
    return digest.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    """The manifest's record of one file: ``{"bytes": size, "sha256": digest}`` (each rank takes its own
    files' records right after writing them, so publishing never re-reads the checkpoint)."""
    return {"bytes": Path(path).stat().st_size, "sha256": file_digest(path)}


def _check_relative_name(name: str) -> None:
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or ".." in parts or name == MANIFEST_NAME:
        raise ValueError(f"manifest file name {name!r} must be a relative path inside the "
                         f"checkpoint directory, without '..', and not {MANIFEST_NAME!r} itself")


def write_manifest(directory: Path, files: list[str], known: Optional[dict[str, dict[str, Any]]] = None) -> None:
    """Write ``directory/manifest.json`` recording the size and sha256 of each of ``files``.

    ``files`` are paths relative to ``directory`` (all ranks' files; the engine gathers the list).
    ``known``: records (:func:`file_entry`) the writers already took; only the other files are hashed here.
    """
    directory = Path(directory)
    entries: dict[str, dict[str, Any]] = {}
    known = known or {}
    names = sorted(set(files))
    for name in progress(names, "checksumming checkpoint", total=len(names), unit="file"):
        _check_relative_name(name)
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"cannot write the manifest of {directory}: {name} was not written "
                                  "(a rank failed to save its part?)")
        if name in known and path.stat().st_size == known[name].get("bytes"):
            entries[name] = dict(known[name])  # a stat, not a second read of the file
        else:
            entries[name] = file_entry(path)
    manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "files": entries}
    save_json(directory / MANIFEST_NAME, manifest)


def _damaged(directory: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {directory} is damaged: {what}. Load another tag (pass tag=... or point "
        f"'{LATEST_NAME}' at an older checkpoint in {directory.parent}) or save it again")


def _read_manifest(directory: Path) -> dict[str, dict[str, Any]]:
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {MANIFEST_NAME}: it is not a deepshard checkpoint "
                              "or its save did not finish; load another tag")
    manifest = load_json(path)
    if (not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT
            or not isinstance(manifest.get("files"), dict)):
        raise _damaged(directory, f"{MANIFEST_NAME} is not a {MANIFEST_FORMAT!r} manifest")
    if manifest.get("version") != MANIFEST_VERSION:
        raise CheckpointError(f"{path} has format version {manifest.get('version')!r}; this deepshard "
                              f"reads version {MANIFEST_VERSION}; upgrade deepshard to load it")
    for name, entry in manifest["files"].items():
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)):
            raise _damaged(directory, f"{MANIFEST_NAME}'s entry for {name!r} should be "
                                      f"{{\"bytes\": <int>, \"sha256\": <hex>}}, found {entry!r:.60}")
    return manifest["files"]


def verify_manifest(directory: Path) -> list[str]:
    """Check every file recorded in ``directory/manifest.json``; raise on the first bad one. Returns the
    recorded names.

    Sizes are checked for all files before any digest is computed, so a truncated file is reported
    without hashing the whole checkpoint.
    """
    directory = Path(directory)
    files = _read_manifest(directory)
    for name, entry in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            raise _damaged(directory, f"{name} is missing")
        size = path.stat().st_size
        if size != entry.get("bytes"):
            raise _damaged(directory, f"{name} is truncated or altered ({size} bytes on disk, "
                                      f"{entry.get('bytes')} bytes recorded in {MANIFEST_NAME})")
    for name, entry in progress(sorted(files.items()), "verifying checkpoint", total=len(files), unit="file"):
        digest = file_digest(directory / name)
        if digest != entry.get("sha256"):
            raise _damaged(directory, f"{name} is corrupted (sha256 {digest[:16]}... differs from "
                                      f"{str(entry.get('sha256'))[:16]}... in {MANIFEST_NAME})")
    return sorted(files)


# --------------------------------------------------------------------------------------------------
# staging, publication, latest, tags
# --------------------------------------------------------------------------------------------------

def validate_tag(tag: str) -> str:
    """Return ``tag`` if it is a safe directory name; ``ValueError`` saying how to fix it otherwise."""
    fix = "use letters, digits, '_', '-' and '.' only, e.g. 'global_step100'"
    if not isinstance(tag, str):
        raise ValueError(f"checkpoint tag must be a str, got {tag!r} ({type(tag).__name__}); "
                         f"convert it with str(); {fix}")
    problems = []
    if not tag:
        problems.append("is empty")
    if "/" in tag or "\\" in tag or (os.altsep and os.altsep in tag):
        problems.append("contains a path separator")
    if ".." in tag:
        problems.append("contains '..'")
    if tag.startswith("."):
        problems.append("starts with '.' (reserved for hidden staging directories)")
    if any(c.isspace() or not c.isprintable() for c in tag):
        problems.append("contains whitespace or control characters")
    if len(tag) > _MAX_TAG_LEN:
        problems.append(f"is {len(tag)} characters long (at most {_MAX_TAG_LEN})")
    if problems:
        raise ValueError(f"checkpoint tag {tag!r} " + " and ".join(problems) + f"; {fix}")
    return tag


def staging_path(save_dir: Path, tag: str) -> Path:
    """Where the processes write a checkpoint before it is published (``save_dir/.tmp-<tag>``)."""
    validate_tag(tag)
    return Path(save_dir) / f".tmp-{tag}"


def staging_dir(save_dir: Path, tag: str) -> Path:
    """Create an empty ``save_dir/.tmp-<tag>`` (removing a leftover one) and return it.

    Only one process (rank 0) may call this, before a barrier: it deletes any previous staging
    directory of the same tag, which is the debris of an interrupted save.
    """
    path = staging_path(save_dir, tag)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _aside_name(save_dir: Path, tag: str) -> Path:
    n = 0
    while (save_dir / f".old-{tag}-{n}").exists():
        n += 1
    return save_dir / f".old-{tag}-{n}"


def _aside_copies(save_dir: Path, tag: str) -> list[Path]:
    """Aside copies of ``tag`` in the order they were made (by their number)."""
    prefix = f".old-{tag}-"
    found = [p for p in save_dir.glob(f".old-{tag}-*") if p.name[len(prefix):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(prefix):]))


def commit_staging(staging: Path, final: Path) -> None:
    """Publish a fully written staging directory as ``final`` (``save_dir/<tag>``).

    If ``final`` exists it is first renamed aside to ``save_dir/.old-<tag>-<n>``, then ``staging`` is
    renamed to ``final``, then the aside copy is deleted. A crash leaves the old or the new checkpoint
    whole under ``final``, or (between the two renames) the old one under the aside name, from which
    :func:`recover_tag` restores it.
    """
    staging, final = Path(staging), Path(final)
    if not staging.is_dir():
        raise CheckpointError(f"staging directory {staging} does not exist; call staging_dir() and "
                              "write the checkpoint files into it before committing")
    validate_tag(final.name)
    save_dir = final.parent
    _fsync_dir(staging)
    aside = None
    if final.exists():
        aside = _aside_name(save_dir, final.name)
        os.rename(final, aside)
    os.rename(staging, final)
    _fsync_dir(save_dir)
    if aside is not None:
        shutil.rmtree(aside)


def recover_tag(save_dir: Path, tag: str) -> bool:
    """Repair ``save_dir`` after a crash inside :func:`commit_staging`; return True if it changed.

    If ``<tag>`` is missing but an aside copy ``.old-<tag>-<n>`` exists, the newest aside copy is
    renamed back to ``<tag>``. Aside copies left next to an existing ``<tag>`` (crash after the new
    checkpoint was published) are deleted. Call it from one process only.
    """
    save_dir = Path(save_dir)
    validate_tag(tag)
    asides = _aside_copies(save_dir, tag)
    if not asides:
        return False
    final = save_dir / tag
    if not final.exists():
        os.rename(asides.pop(), final)
        _fsync_dir(save_dir)
    for aside in asides:
        shutil.rmtree(aside)
    return True


def _aside_tags(save_dir: Path) -> set[str]:
    """Tags that have aside copies ``.old-<tag>-<n>`` in ``save_dir``."""
    tags = set()
    for p in save_dir.glob(".old-*-*"):
        body, _, n = p.name[len(".old-"):].rpartition("-")
        if body and n.isdigit() and p.is_dir():
            tags.add(body)
    return tags


def repair_save_dir(save_dir: Path, keep: str | None = None) -> list[str]:
    """Undo what interrupted saves left in ``save_dir``; return what was done, one line per change.

    Every tag whose publication was interrupted between its two renames gets its intact copy back
    (:func:`recover_tag`), leftover aside copies next to a published tag are deleted, and hidden
    staging directories ``.tmp-<tag>`` of saves that never committed are removed (except ``keep``'s,
    the save under way). Call it from one process only, while no other save to ``save_dir`` runs.
    """
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    done = []
    for tag in sorted(_aside_tags(save_dir)):
        try:
            validate_tag(tag)
        except ValueError:
            continue
        missing = not (save_dir / tag).exists()
        if recover_tag(save_dir, tag):
            done.append(f"restored {tag} from its aside copy" if missing else f"removed stale aside copies of {tag}")
    for stale in sorted(save_dir.glob(".tmp-*")):
        if stale.is_dir() and stale.name != f".tmp-{keep}":
            shutil.rmtree(stale, ignore_errors=True)
            done.append(f"removed the staging directory {stale.name} of an interrupted save")
    return done


def write_latest(save_dir: Path, tag: str) -> None:
    """Atomically write ``save_dir/latest`` containing ``tag`` (no newline, as DeepSpeed does)."""
    validate_tag(tag)
    _write_bytes_atomic(Path(save_dir) / LATEST_NAME, tag.encode("utf-8"))


def read_latest(save_dir: Path) -> str | None:
    """The tag in ``save_dir/latest``, or None if there is no such file."""
    path = Path(save_dir) / LATEST_NAME
    try:
        tag = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path} is not UTF-8 text; it is corrupted: write the tag to load "
                              "into it (e.g. 'global_step100') or pass tag=... explicitly") from err
    try:
        return validate_tag(tag)
    except ValueError as err:
        raise CheckpointError(f"{path} does not hold a valid tag: {err}; write the tag to load into "
                              "it or pass tag=... explicitly") from err
