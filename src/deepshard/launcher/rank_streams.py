"""Where torch's elastic agent sends each rank's output: a named pipe per rank that the launcher reads."""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import BinaryIO

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

from deepshard.launcher.preflight import prepare_log_dir
from deepshard.launcher.output import Output, describe_exit, pump


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

    def text(self) -> str:
        return bytes(self.tail).decode("utf-8", errors="replace").rstrip()


class RankStreams(LogsSpecs):
    """A ``LogsSpecs`` for torch's agent: every rank's stdout+stderr into a pipe the launcher forwards."""

    def __init__(self, out: Output, log_dir: str | None = None) -> None:
        super().__init__(log_dir=None)
        self.out = out
        self.log_dir = log_dir
        if log_dir is not None:
            prepare_log_dir(log_dir)
        self._tmp = tempfile.mkdtemp(prefix="deepshard-ranks-")
        self.streams: dict[int, RankStream] = {}

    @property
    def root_log_dir(self) -> str:  # abstract in torch's LogsSpecs
        return self.log_dir or self._tmp

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Fresh pipes (and readers) for the attempt torch is about to start."""
        self.finish()
        dest = LogsDest()
        for local_rank, env in sorted(envs.items()):
            attempt, rank = env.get("TORCHELASTIC_RESTART_COUNT", "0"), int(env["RANK"])
            path = os.path.join(self._tmp, f"attempt{attempt}-rank{rank}.pipe")
            error_file = os.path.join(self._tmp, f"attempt{attempt}-rank{rank}-error.json")
            log_path = os.path.join(self.log_dir, f"rank_{rank}.log") if self.log_dir is not None else None
            stream = RankStream(rank, local_rank, log_path, error_file)
            self._open(stream, path)
            self.streams[local_rank] = stream
            dest.stdouts[local_rank] = dest.stderrs[local_rank] = path
            dest.error_files[local_rank] = error_file
            env["TORCHELASTIC_ERROR_FILE"] = error_file
        return dest

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

    def mark_exited(self, local_rank: int, returncode: int, pid: int) -> RankStream:
        """The agent saw ``local_rank`` exit: stamp the time (failures then hold the others' output)."""
        stream = self.streams[local_rank]
        if stream.ended_at is None:
            stream.ended_at, stream.returncode, stream.pid = time.monotonic(), returncode, pid
        return stream

    def finish(self, timeout_s: float = 2.0) -> None:
        """Close the launcher's write ends and let the readers drain what the ranks wrote."""
        for stream in self.streams.values():
            if stream.write_fd >= 0:
                os.close(stream.write_fd)
                stream.write_fd = -1
        deadline = time.monotonic() + timeout_s
        for stream in self.streams.values():
            if stream.reader is not None:
                stream.reader.join(max(0.0, deadline - time.monotonic()))
        self.out.flush_stale(list(self.streams.values()), 0.0)  # no failure to report first: all out now

    def cleanup(self) -> None:
        """End of the launch: readers drained, the pipes' directory removed."""
        self.finish()
        shutil.rmtree(self._tmp, ignore_errors=True)
