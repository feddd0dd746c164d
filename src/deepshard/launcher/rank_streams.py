"""Where torch's elastic agent sends each rank's output: a named pipe per rank that the launcher reads."""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO

from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs

from deepshard.launcher.preflight import prepare_log_dir
from deepshard.launcher.output import Output, describe_exit, pump
from deepshard.launcher.rank_watch import OUTPUT_ENV


@dataclass
class RankStream:
    """One rank's output in one attempt (what :func:`~deepshard.launcher.output.pump` fills)."""

    rank: int
    local_rank: int
    log_path: str | None = None
    error_file: str = ""
    tail: bytearray = field(default_factory=bytearray)
    held: bytearray = field(default_factory=bytearray)
    held_since: float = 0.0
    ended_at: float | None = None  # ``time.monotonic()`` when the agent saw the rank exit.
    returncode: int | None = None
    pid: int | None = None
    reader: threading.Thread | None = None
    write_fd: int = -1

    @property
    def name(self) -> str:
        return f"rank {self.rank}"

    @property
    def who(self) -> str:
        return f"rank {self.rank} (local rank {self.local_rank}, pid {self.pid})"

    @property
    def exit(self) -> str:
        return describe_exit(self.returncode or 1)

    @property
    def running(self) -> bool:
        return self.pid is not None and self.returncode is None

    def text(self) -> str:
        return bytes(self.tail).decode("utf-8", errors="replace").rstrip()


class RankStreams(LogsSpecs):
    """A ``LogsSpecs`` for torch's agent: every rank's stdout+stderr into a pipe the launcher forwards."""

    def __init__(self, out: Output, log_dir: str | None = None,
                 on_attempt: Callable[[dict[int, dict[str, str]]], None] | None = None) -> None:
        super().__init__(log_dir=None)
        self.out, self.log_dir, self.on_attempt = out, log_dir, on_attempt
        if log_dir is not None:
            prepare_log_dir(log_dir)
        self._tmp = tempfile.mkdtemp(prefix="deepshard-ranks-")
        self.streams: dict[int, RankStream] = {}
        self.attempt = -1

    @property
    def root_log_dir(self) -> str:  # abstract in torch's LogsSpecs
        return self.log_dir or self._tmp

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Fresh pipes (and readers) for the attempt torch is about to start; ``on_attempt`` sees its variables."""
        self.finish()
        self.attempt += 1
        dest, self.streams = LogsDest(), {}
        for local_rank, env in sorted(envs.items()):
            rank, stem = int(env["RANK"]), os.path.join(self._tmp, f"attempt{self.attempt}-rank{env['RANK']}")
            log_path = os.path.join(self.log_dir, f"rank_{rank}.log") if self.log_dir is not None else None
            stream = RankStream(rank, local_rank, log_path, f"{stem}-error.json")
            self._open(stream, f"{stem}.pipe")
            self.streams[local_rank] = stream
            dest.stdouts[local_rank] = dest.stderrs[local_rank] = ""  # torch's: none; the shim opens the pipe
            env[OUTPUT_ENV] = f"{stem}.pipe"
            dest.error_files[local_rank] = env["TORCHELASTIC_ERROR_FILE"] = stream.error_file
        if self.on_attempt is not None:
            self.on_attempt(envs)
        return dest

    def path(self, name: str) -> str:
        """A path in this launch's scratch directory (removed at the end)."""
        return os.path.join(self._tmp, name)

    def _open(self, stream: RankStream, path: str) -> None:
        os.mkfifo(path)
        read_fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        stream.write_fd = os.open(path, os.O_WRONLY)  # ours: no end-of-file before the rank writes
        os.set_blocking(read_fd, True)
        reader: BinaryIO = os.fdopen(read_fd, "rb", buffering=0)
        log = open(stream.log_path, "wb") if stream.log_path is not None else None  # noqa: SIM115
        stream.reader = threading.Thread(target=pump, args=(reader, stream, self.out, log),
                                         name=f"deepshard-out-{stream.rank}", daemon=True)
        stream.reader.start()

    def mark_exited(self, local_rank: int, returncode: int) -> RankStream:
        """``local_rank`` exited: stamp the time (failures then hold the others' output)."""
        stream = self.streams[local_rank]
        if stream.ended_at is None:
            stream.ended_at, stream.returncode = time.monotonic(), returncode
        return stream

    def opened(self, local_rank: int) -> None:
        """The rank's shim holds its pipe: the launcher's write end goes (end-of-file when the rank's are gone)."""
        stream = self.streams[local_rank]
        if stream.write_fd >= 0:
            os.close(stream.write_fd)
            stream.write_fd = -1

    def finish(self, timeout_s: float = 2.0) -> None:
        """Close the launcher's write ends and let the readers drain what the ranks wrote."""
        for local_rank in self.streams:
            self.opened(local_rank)
        deadline = time.monotonic() + timeout_s
        for stream in self.streams.values():
            if stream.reader is not None:
                stream.reader.join(max(0.0, deadline - time.monotonic()))
        self.out.flush_stale(list(self.streams.values()), 0.0)  # no failure to report first: all out now

    def cleanup(self) -> None:
        """End of the launch: readers drained, the pipes' directory removed."""
        self.finish()
        shutil.rmtree(self._tmp, ignore_errors=True)
