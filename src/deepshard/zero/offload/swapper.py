"""Asynchronous tensor I/O to swap files: the disk side of ZeRO-Infinity.

Each swapper owns one directory ``<nvme_path>/deepshard-<pid>-<id>-rank<r>/`` and a few named files
in it (``create``), each reserved at its full size up front with ``posix_fallocate``, so a disk that
is too small fails at set-up, before training changes anything, with an error that names the path, the
bytes needed and the bytes free. ``read`` / ``write`` move a contiguous CPU tensor from / to a byte
offset of a file and return at once with an :class:`IOOp`; the work is done by ``thread_count`` worker
threads with positional ``preadv`` / ``pwrite`` calls of at most ``block_size`` bytes (the GIL is
released during the system calls, so threads really overlap with each other and with compute). At
most ``queue_depth`` operations are outstanding; submitting one more waits for the oldest to finish.

Failures: an ``OSError`` in a worker (a full disk, an I/O error) becomes a :class:`SwapError` raised by
``IOOp.wait``; a failed write also marks its file as damaged, so any later read of it raises instead
of returning bytes that were never written (no half-written state is ever used). ``close`` (or, if the
owner forgets, garbage collection or interpreter exit via ``weakref.finalize``) waits for pending
operations and removes the files and the directory.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import os
import sys
import shutil
import threading
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from deepshard.utils.logging import logger
from deepshard.zero.offload.policy import AioSettings
from deepshard.zero.offload.reclaim import LOCK_NAME, exit_on_sigterm, hold_lock, reclaim_stale


class SwapError(RuntimeError):
    """A swap file could not be created, written or read (disk full, I/O error, damaged file)."""


@dataclass
class _SwapFile:
    path: Path
    fd: int
    nbytes: int
    damaged: str | None = None  # why its contents cannot be trusted


class IOOp:
    """One read or write in flight: ``wait()`` blocks until it is done and raises its error if any."""

    def __init__(self, keep: torch.Tensor | None, parts: int) -> None:
        self._keep = keep  # the tensor must outlive the I/O
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._remaining = parts
        self._callbacks: list[Callable[[IOOp], None]] = []
        self.error: BaseException | None = None
        if parts == 0:
            self._finish()

    def _part_done(self, error: BaseException | None) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        self._keep = None
        self._event.set()
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def add_done_callback(self, fn: Callable[["IOOp"], None]) -> None:
        """Call ``fn(op)`` once the operation is finished (at once if it already is)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        self._event.wait()
        if self.error is not None:
            raise self.error


class CompletedOp(IOOp):
    """An operation that needed no I/O."""

    def __init__(self) -> None:
        super().__init__(None, 0)


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"swap I/O needs a contiguous CPU tensor, got device={tensor.device} "
                         f"contiguous={tensor.is_contiguous()}")
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


class AsyncSwapper:
    """Named swap files of one process under ``root`` with asynchronous positional I/O."""

    def __init__(self, root: str | Path, rank: int, aio: AioSettings | None = None) -> None:
        self.aio = aio or AioSettings()
        if self.aio.block_size < 1 or self.aio.queue_depth < 1 or self.aio.thread_count < 1:
            raise ValueError(f"aio.block_size ({self.aio.block_size}), aio.queue_depth ({self.aio.queue_depth}) and "
                             f"aio.thread_count ({self.aio.thread_count}) must all be at least 1")
        self.root = Path(root)
        self.reclaimed = reclaim_stale(self.root)
        self.directory = self.root / f"deepshard-{os.getpid()}-{uuid.uuid4().hex[:8]}-rank{rank}"
        missing = not self.root.exists()
        try:
            self.directory.mkdir(parents=True, exist_ok=False)
            self._lock_fd = hold_lock(self.directory)
        except OSError as err:
            raise SwapError(f"cannot create the swap directory {self.directory}: {err.strerror or err}; point "
                            "nvme_path at a writable directory") from err
        exit_on_sigterm()
        if missing:
            logger.warning("nvme_path %s did not exist; created it for the swap files (rank %d). Point "
                           "nvme_path at a directory on a fast local disk if this is not one", self.root, rank)
        self._files: dict[str, _SwapFile] = {}
        self._executor = ThreadPoolExecutor(max_workers=self.aio.thread_count, thread_name_prefix="deepshard-aio")
        self._slots = threading.BoundedSemaphore(self.aio.queue_depth)
        self._pending: set[IOOp] = set()
        self._pending_lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0
        self.closed = False
        self._finalizer = weakref.finalize(self, _cleanup, self.directory, self._files, self._executor,
                                           self._lock_fd)

    # ------------------------------------------------------------------------------------ files
    def create(self, name: str, nbytes: int) -> Path:
        """Create file ``name`` with ``nbytes`` reserved on disk (zeros until written)."""
        if name in self._files:
            raise ValueError(f"swap file {name!r} already exists in {self.directory}")
        path = self.directory / f"{name}.swp"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _reserve(fd, path, nbytes)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self._files[name] = _SwapFile(path, fd, nbytes)
        return path

    def has(self, name: str) -> bool:
        return name in self._files

    def nbytes(self) -> int:
        """Bytes reserved on disk by this swapper's files."""
        return sum(f.nbytes for f in self._files.values())

    # -------------------------------------------------------------------------------------- I/O
    def write(self, name: str, offset: int, tensor: torch.Tensor,
              on_done: Callable[[IOOp], None] | None = None) -> IOOp:
        """Start writing ``tensor``'s bytes at byte ``offset`` of file ``name``."""
        return self._submit("write", name, offset, tensor, on_done)

    def read(self, name: str, offset: int, into: torch.Tensor, on_done: Callable[[IOOp], None] | None = None) -> IOOp:
        """Start reading ``into.nbytes`` bytes at byte ``offset`` of file ``name`` into ``into``."""
        f = self._file(name)
        if f.damaged is not None:
            raise SwapError(f"{f.path} cannot be read: {f.damaged}")
        return self._submit("read", name, offset, into, on_done)

    def discard(self, name: str, keep_blocks: bool = False) -> bool:
        """Drop the contents of file ``name`` (it reads as zeros after): its cached pages go without being
        written to the disk, which is what makes a scratch file whose values are dead (the gradients once
        the step has read them) cost no disk writes. Frees the file's blocks, so a later write takes disk
        space again (and fails with a :class:`SwapError` if the disk filled meanwhile); with
        ``keep_blocks`` the blocks stay reserved (``FALLOC_FL_ZERO_RANGE``: what a file written through a
        memory mapping needs, where a full disk cannot raise). Call it with no operation on the file in
        flight. Returns False where the file system cannot (nothing changes)."""
        f = self._file(name)
        fn = _fallocate()
        if fn is None or f.nbytes == 0:
            return False
        mode = _ZERO_RANGE | _KEEP_SIZE if keep_blocks else _PUNCH_HOLE | _KEEP_SIZE
        return fn(f.fd, mode, 0, f.nbytes) == 0  # type: ignore[operator]

    def fileno(self, name: str) -> int:
        """The open descriptor of file ``name`` (owned by the swapper: do not close it)."""
        return self._file(name).fd

    def wait(self) -> None:
        """Wait for every outstanding operation; raise the first error among them."""
        with self._pending_lock:
            ops = list(self._pending)
        first: BaseException | None = None
        for op in ops:
            try:
                op.wait()
            except BaseException as err:  # noqa: BLE001 - wait for the rest, then raise the first
                first = first or err
        if first is not None:
            raise first

    def _file(self, name: str) -> _SwapFile:
        if self.closed:
            raise SwapError(f"the swapper of {self.directory} is closed (the engine was destroyed)")
        f = self._files.get(name)
        if f is None:
            raise KeyError(f"no swap file {name!r} in {self.directory}; known: {sorted(self._files)}")
        return f

    def _submit(self, kind: str, name: str, offset: int, tensor: torch.Tensor,
                on_done: Callable[[IOOp], None] | None) -> IOOp:
        f = self._file(name)
        view = _as_bytes(tensor)
        nbytes = len(view)
        if offset < 0 or offset + nbytes > f.nbytes:
            raise ValueError(f"{kind} of {nbytes} bytes at offset {offset} is outside {f.path} ({f.nbytes} bytes)")
        block = self.aio.block_size
        nblocks = -(-nbytes // block)
        parts = min(self.aio.thread_count, nblocks)
        per = -(-nblocks // parts) * block if parts else 0
        self._slots.acquire()
        op = IOOp(tensor, parts)
        with self._pending_lock:
            self._pending.add(op)
        op.add_done_callback(self._retire)
        if on_done is not None:
            op.add_done_callback(on_done)
        if kind == "write":
            self.bytes_written += nbytes
        else:
            self.bytes_read += nbytes
        for i in range(parts):
            lo, hi = i * per, min((i + 1) * per, nbytes)
            self._executor.submit(self._run_part, kind, f, view, offset, lo, hi, op)
        return op

    def _retire(self, op: IOOp) -> None:
        with self._pending_lock:
            self._pending.discard(op)
        self._slots.release()

    def _run_part(self, kind: str, f: _SwapFile, view: memoryview, offset: int, lo: int, hi: int, op: IOOp) -> None:
        error: BaseException | None = None
        try:
            block = self.aio.block_size
            pos = lo
            while pos < hi:
                end = min(pos + block, hi)
                if kind == "write":
                    done = os.pwrite(f.fd, view[pos:end], offset + pos)
                else:
                    done = os.preadv(f.fd, [view[pos:end]], offset + pos)
                    if done == 0:
                        raise SwapError(f"{f.path} ended at byte {offset + pos}, before the {hi - lo} bytes "
                                        "expected: the swap file was truncated by something else")
                pos += done
        except OSError as err:
            error = _io_error(kind, f, offset + lo, hi - lo, err)
            if kind == "write":
                f.damaged = f"an earlier write failed ({error})"
        except BaseException as err:  # noqa: BLE001 - reported through the op
            error = err
        op._part_done(error)

    # ---------------------------------------------------------------------------------- cleanup
    def close(self) -> None:
        """Wait for outstanding I/O, then remove the files and the directory. Safe to call twice."""
        if self.closed:
            return
        try:
            self.wait()
        except BaseException:  # noqa: BLE001 - closing anyway; the files go
            pass
        self.closed = True
        self._executor.shutdown(wait=True)
        self._finalizer()


_KEEP_SIZE, _PUNCH_HOLE, _ZERO_RANGE = 0x01, 0x02, 0x10  # linux/falloc.h


@functools.lru_cache(maxsize=1)
def _fallocate() -> object | None:
    """libc's ``fallocate`` on Linux (to punch holes), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    fn.restype = ctypes.c_int
    return fn


def _reserve(fd: int, path: Path, nbytes: int) -> None:
    if nbytes <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as err:
        if err.errno in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
            os.ftruncate(fd, nbytes)  # a filesystem without fallocate: sparse file, space taken as written
            return
        raise _io_error("reserve", _SwapFile(path, fd, nbytes), 0, nbytes, err) from err


def _io_error(kind: str, f: _SwapFile, offset: int, nbytes: int, err: OSError) -> SwapError:
    try:
        free = shutil.disk_usage(f.path.parent).free
        free_text = f"{free} bytes ({free / 2**30:.2f} GiB) are free there"
    except OSError:
        free_text = "the free space could not be read"
    what = {"reserve": f"reserving {nbytes} bytes ({nbytes / 2**30:.2f} GiB) for",
            "write": f"writing {nbytes} bytes at offset {offset} of",
            "read": f"reading {nbytes} bytes at offset {offset} of"}[kind]
    if err.errno == errno.ENOSPC:
        return SwapError(f"no space left on the device {what} the swap file {f.path}: {free_text}. Free up "
                         "space or point nvme_path at a larger disk (the swap files need about 12 bytes per "
                         "parameter for mixed-precision Adam, divided among the processes)")
    return SwapError(f"I/O error {what} the swap file {f.path}: {err.strerror or err} (errno {err.errno}); "
                     f"{free_text}")


def _cleanup(directory: Path, files: dict[str, _SwapFile], executor: ThreadPoolExecutor, lock_fd: int) -> None:
    executor.shutdown(wait=False)  # (may run in a worker thread when garbage collection ends the swapper)
    for f in list(files.values()):
        try:
            os.close(f.fd)
        except OSError:
            pass
        f.path.unlink(missing_ok=True)
    files.clear()
    (directory / LOCK_NAME).unlink(missing_ok=True)
    try:
        os.close(lock_fd)
    except OSError:
        pass
    try:
        directory.rmdir()
    except OSError:
        pass


__all__ = ["AsyncSwapper", "IOOp", "CompletedOp", "SwapError"]
