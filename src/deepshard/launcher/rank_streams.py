"""Each rank's side channels to the launcher. torch's elastic agent starts deepshard's rank shim (:data:`RANK_SHIM`)
for every rank. The shim ties itself and the rank to the agent (Linux's ``PR_SET_PDEATHSIG``: nothing outlives the
agent), pins the rank's cores, sets deepshard's variables, sends the rank's output to a named pipe the launcher reads
(:class:`RankStreams`, the ``LogsSpecs`` torch's agent is given), runs the rank's command as its child, writes
``start <local rank> <pid> <process group>`` and ``exit <local rank> <pid> <returncode>`` to a status pipe
(:func:`watch_ranks`), and ends as the rank did. So the first failure holds the other ranks' output before their
fallout arrives, and the other ranks are stopped at once, while torch's agent still starts, reaps and restarts the
shims on its own schedule. The agent's signals go to the whole process group (torch's and deepshard's alike), so the
rank gets each once, and the shim, which ignores them, waits for the rank's exit to report it."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs

from deepshard.launcher.options import prepare_log_dir
from deepshard.launcher.output import Output, describe_exit, pump

STATUS_ENV = "DEEPSHARD_RANK_STATUS"
OUTPUT_ENV = "DEEPSHARD_RANK_OUTPUT"
"""The variables naming the shim's pipes in each rank's environment (it removes them before the command runs):
the one it reports on, and the one it sends the rank's stdout and stderr to."""
READER_END_S = 30.0  # how long an ended attempt waits for the rank-status reader's last callbacks

RANK_SHIM = """\
import ctypes, json, os, signal, sys
libc = ctypes.CDLL(None)
libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the agent
if os.getppid() != int(sys.argv[1]):
    os._exit(1)  # the agent died before the guard was set
setup, env = json.loads(sys.argv[2]), os.environ
local = int(env['LOCAL_RANK'])
cores = setup['cores'][local] if setup['cores'] else None
if cores:
    os.sched_setaffinity(0, cores)
env.update(setup['env'])
if cores and not setup['own_omp']:
    env['OMP_NUM_THREADS'] = str(len(cores))
env['DEEPSHARD_RESTART_COUNT'] = env.get('TORCHELASTIC_RESTART_COUNT', '0')
env['CROSS_RANK'], env['CROSS_SIZE'] = env.get('GROUP_RANK', '0'), env.get('GROUP_WORLD_SIZE', '1')
status = os.open(env.pop('DEEPSHARD_RANK_STATUS'), os.O_WRONLY)
output = os.open(env.pop('DEEPSHARD_RANK_OUTPUT'), os.O_WRONLY)
os.dup2(output, 1)
os.dup2(output, 2)
os.close(output)
shim = os.getpid()
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, lambda sig, frame: None)  # they reach the rank through its process group: outlive it
pid = os.fork()
if pid == 0:
    libc.prctl(1, signal.SIGKILL)  # the rank dies with this shim
    if os.getppid() != shim:
        os._exit(1)
    os.close(status)
    try:
        os.execvp(sys.argv[3], sys.argv[3:])
    except OSError as exc:
        print(f'deepshard: cannot run {sys.argv[3]!r}: {exc}', file=sys.stderr, flush=True)
        os._exit(127)
os.write(status, f'start {local} {pid} {os.getpgid(0)}\\n'.encode())
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
os.write(status, f'exit {local} {pid} {code}\\n'.encode())
if code < 0:  # end as the rank did: by its signal
    if -code not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(-code, signal.SIG_DFL)
    os.kill(shim, -code)
os._exit(code)
"""


def shim_argv(command: Sequence[str], agent_pid: int, cores: Sequence[Sequence[int]] | None,
              env: dict[str, str], own_omp: bool, python: str = sys.executable) -> tuple[str, list[str]]:
    """torch's entrypoint and arguments for every rank: the shim, then the rank's command."""
    setup = {"cores": [list(c) for c in cores] if cores else None, "env": env, "own_omp": own_omp}
    return python, ["-c", RANK_SHIM, str(agent_pid), json.dumps(setup), *command]


def open_fifo(path: str) -> tuple[int, int]:
    """A named pipe at ``path``: (a blocking read end, a write end the launcher holds, so that the reader sees no
    end-of-file before the ranks' shims open it)."""
    os.mkfifo(path)
    read_fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    write_fd = os.open(path, os.O_WRONLY)
    os.set_blocking(read_fd, True)
    return read_fd, write_fd


def watch_ranks(path: str, on_start: Callable[[int, int, int], None],
                on_exit: Callable[[int, int, int], None]) -> Callable[[], None]:
    """Watch one attempt's ranks through the shim's pipe at ``path``: ``on_start(local_rank, pid, pgid)``, then
    ``on_exit(local_rank, pid, returncode)`` (``Popen``'s convention: ``-N`` for signal N). Returns the call that
    ends the watch once the attempt is over (every shim gone): the reader takes the last reports and ends."""
    read_fd, write_fd = open_fifo(path)

    def read() -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            pending = b""
            while chunk := pipe.read(4096):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    what, *numbers = line.split()
                    (on_start if what == b"start" else on_exit)(*(int(n) for n in numbers))

    reader = threading.Thread(target=read, name="deepshard-rank-status", daemon=True)
    reader.start()

    def close() -> None:
        os.close(write_fd)
        # the last report may still be in flight (a failure published to the job board over the network): the
        # agent must not report or exit before it lands. EOF comes as soon as the shims are gone, so this waits
        # for the callbacks, not for the pipe; the bound covers a store that stopped answering.
        reader.join(READER_END_S)

    return close


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

    def __init__(self, out: Output, log_dir: str | None = None) -> None:
        super().__init__(log_dir=None)
        self.out, self.log_dir = out, log_dir
        self.on_attempt: Callable[[dict[int, dict[str, str]]], None] | None = None
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
            self.streams[local_rank] = stream = RankStream(rank, local_rank, log_path, f"{stem}-error.json")
            read_fd, stream.write_fd = open_fifo(f"{stem}.pipe")
            log = open(log_path, "wb") if log_path is not None else None  # noqa: SIM115 - the reader closes it
            stream.reader = threading.Thread(target=pump, args=(os.fdopen(read_fd, "rb", buffering=0), stream,
                                                                self.out, log), name=f"deepshard-out-{rank}", daemon=True)
            stream.reader.start()
            dest.stdouts[local_rank] = dest.stderrs[local_rank] = ""  # torch's: none; the shim opens the pipe
            env[OUTPUT_ENV] = f"{stem}.pipe"
            dest.error_files[local_rank] = env["TORCHELASTIC_ERROR_FILE"] = stream.error_file
        if self.on_attempt is not None:
            self.on_attempt(envs)
        return dest

    def path(self, name: str) -> str:
        """A path in this launch's scratch directory (removed at the end)."""
        return os.path.join(self._tmp, name)

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
