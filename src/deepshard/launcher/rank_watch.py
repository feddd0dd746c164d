"""Each rank's start and exit, the moment they happen. torch's agent starts deepshard's rank shim
(:data:`RANK_SHIM`), which runs the rank's command as its child and writes ``"<local rank> <pid>"`` when it
starts and ``"<local rank> <pid> <returncode>"`` when it ends to a named pipe this module reads. So the first
failure holds the other ranks' output before their fallout arrives, and the other ranks are stopped at once,
while torch's agent still starts, reaps and restarts the shims on its own schedule."""
from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Sequence

STATUS_ENV = "DEEPSHARD_RANK_STATUS"
OUTPUT_ENV = "DEEPSHARD_RANK_OUTPUT"
"""The variables naming the shim's pipes in each rank's environment (it removes them before the command runs):
the one it reports on, and the one it sends the rank's stdout and stderr to."""

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
"""What torch's agent runs for each rank: it ties itself and the rank to the agent (Linux's
``PR_SET_PDEATHSIG``: nothing outlives the agent), pins the rank's cores, sets deepshard's variables, sends the
rank's output to its pipe, runs the command as its child, reports the rank's pid (and the process group torch
started it in) and its exit, and ends as the rank did. The agent's signals go to the whole process group (torch's
and deepshard's alike), so the rank gets each once, and the shim waits for the rank's exit to report it."""


def shim_argv(command: Sequence[str], agent_pid: int, cores: Sequence[Sequence[int]] | None,
              env: dict[str, str], own_omp: bool, python: str = sys.executable) -> tuple[str, list[str]]:
    """torch's entrypoint and arguments for every rank: the shim, then the rank's command."""
    setup = {"cores": [list(c) for c in cores] if cores else None, "env": env, "own_omp": own_omp}
    return python, ["-c", RANK_SHIM, str(agent_pid), json.dumps(setup), *command]


class RankWatch:
    """Watches one attempt's ranks through the shim's pipe at ``path``: ``on_start(local_rank, pid, pgid)``, then
    ``on_exit(local_rank, pid, returncode)`` (``Popen``'s convention: ``-N`` for signal N)."""

    def __init__(self, path: str, on_start: Callable[[int, int, int], None],
                 on_exit: Callable[[int, int, int], None]) -> None:
        self.path, self._on_start, self._on_exit = path, on_start, on_exit
        os.mkfifo(path)
        read_fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self._write_fd = os.open(path, os.O_WRONLY)  # ours: no end-of-file before the ranks write
        os.set_blocking(read_fd, True)
        self._reader = threading.Thread(target=self._read, args=(read_fd,), name="deepshard-rank-status", daemon=True)
        self._reader.start()

    def _read(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            pending = b""
            while chunk := pipe.read(4096):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    what, *numbers = line.split()
                    (self._on_start if what == b"start" else self._on_exit)(*(int(n) for n in numbers))

    def close(self) -> None:
        """The attempt is over (every shim gone): let the reader take the last reports and end."""
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd = -1
        self._reader.join(2.0)
