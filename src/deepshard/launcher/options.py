"""Command-line options of the ``deepshard`` launcher and of its per-node agent (DeepSpeed's flags), and the
checks made before a rank starts, so that a bad value is a one-line error naming the flag and the fix instead of a
traceback from a rank: port numbers, a port already taken, an unwritable log directory. (A hostfile that is not
text is refused by :func:`deepshard.launcher.hostfile.read_hostfile`.)"""
from __future__ import annotations

import argparse
import errno
import os
import socket
from collections.abc import Mapping
from typing import NoReturn

DEFAULT_HOSTFILE = "/job/hostfile"
DEFAULT_MASTER_PORT = 29500
PID_FILE_DIR = "/tmp"

class LaunchError(ValueError):
    """A command line or resource selection that cannot be launched; the message says why and how to fix."""


# ``--launcher`` values: ``pdsh`` (the default) falls back to ``ssh`` when pdsh is not installed.
LAUNCHERS = ("pdsh", "ssh", "openmpi", "mpich", "impi", "mvapich", "slurm")


def add_resource_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-H", "--hostfile", default=DEFAULT_HOSTFILE,
                        help="hostfile of '<host> slots=<n>' lines; missing means this machine only")
    parser.add_argument("-i", "--include", default="", help="NODE_SPEC[@NODE_SPEC...], e.g. 'worker-0@worker-1:0,2'")
    parser.add_argument("-e", "--exclude", default="", help="NODE_SPEC[@NODE_SPEC...] to leave out")
    parser.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile; -1: all")
    parser.add_argument("--num_gpus", "--num_accelerators", dest="num_gpus", type=int, default=-1,
                        help="slots [0, N) per node; on a CPU machine, the number of processes; -1: every GPU, "
                             "or 1 process on a CPU machine")
    parser.add_argument("--master_port", type=port_number, default=DEFAULT_MASTER_PORT,
                        help="port of the nodes' rendezvous (torch's c10d store, served by node 0's agent); 0: a free "
                             "port (one machine only; the launcher logs it)")
    parser.add_argument("--master_addr", default="",
                        help="rendezvous address (default: 127.0.0.1 on one machine, else the first host)")
    parser.add_argument("--node_rank", type=int, default=-1,
                        help="this machine's index in the selected hosts (with --no_ssh); -1: unset")


def add_multi_node_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--launcher", default="pdsh", choices=LAUNCHERS,
                        help="multi-node runner: pdsh (ssh when pdsh is missing), ssh, openmpi, mpich, "
                             "impi, mvapich, slurm")
    parser.add_argument("--launcher_args", default="",
                        help="extra arguments for the runner (pdsh, ssh, mpirun or srun), one quoted string")
    parser.add_argument("--no_ssh", action="store_true",
                        help="multi-node without ssh: run the same command on every node with --node_rank")
    parser.add_argument("--no_ssh_check", action="store_true", help="skip the ssh reachability check")
    parser.add_argument("--force_multi", action="store_true", help="use the multi-node path even for one node")
    parser.add_argument("--ssh_port", type=int, default=None, help="ssh port for the ssh/pdsh runners")
    parser.add_argument("--venv_script", default=None, help="script sourced on each node before launch")
    parser.add_argument("--max_restarts", type=int, default=0,
                        help="restart every rank up to N times after a failure (the script resumes from "
                             "its checkpoint; DEEPSHARD_RESTART_COUNT tells it which attempt it is)")
    parser.add_argument("--autotuning", default="", choices=["", "tune", "run"],
                        help="search ZeRO stage x micro batch with short trials (tune), then train with the best (run)")
    add_elastic_args(parser)


def add_elastic_args(parser: argparse.ArgumentParser) -> None:
    """DeepSpeed's elastic flags: torch's c10d rendezvous, nodes joining and leaving between restarts."""
    parser.add_argument("--elastic_training", action="store_true",
                        help="let nodes join and leave: torch's c10d rendezvous on master_addr:master_port forms "
                             "each attempt's world from the nodes present (ranks numbered by arrival); a lost "
                             "node restarts the others (--max_restarts) without it")
    parser.add_argument("--min_elastic_nodes", type=int, default=-1,
                        help="with --elastic_training: fewest nodes to train with (-1: 1)")
    parser.add_argument("--max_elastic_nodes", type=int, default=-1,
                        help="with --elastic_training: most nodes (-1: the selected hosts)")


def add_process_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--module", action="store_true", help="run user_script as 'python -m <module>'")
    parser.add_argument("--no_python", action="store_true", help="run user_script directly, not via python")
    parser.add_argument("--no_local_rank", action="store_true", help="do not append --local_rank=N")
    parser.add_argument("--save_pid", action="store_true",
                        help=f"write {PID_FILE_DIR}/<launcher pid>.deepshard: the launcher pid, then the "
                             "rank pids, one per line; removed when the launcher exits")
    parser.add_argument("--enable_each_rank_log", default=None, metavar="DIR",
                        help="also write each rank's output to DIR/rank_<N>.log (on the rank's machine)")
    parser.add_argument("--bind_cores_to_rank", action="store_true",
                        help="pin each rank to an equal share of its machine's CPU cores; "
                             "OMP_NUM_THREADS = share")
    parser.add_argument("--bind_core_list", default=None, help="cores to share out, e.g. '0,2-5'")
    parser.add_argument("--log_level", default=None, choices=["debug", "info", "warning", "error", "critical"],
                        help="launcher log level (default: DEEPSHARD_LOG_LEVEL, else info)")
    parser.add_argument("-q", "--quiet", action="store_true", help="launcher logs warnings and errors only")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show the full traceback of a rank's config error (by default each distinct "
                             "message is printed once, as one line)")
    parser.add_argument("--replace_deepspeed", action="store_true",
                        help="when a real DeepSpeed is installed, make the script's `import deepspeed` run "
                             "deepshard anyway (without it, DeepSpeed runs and the launcher says so)")


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number; give an integer in 1..65535 "
                                         "(0: a free port)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is outside 1..65535; pick a free port in that range, "
                                         "e.g. 29500, or 0 for any free port")
    return port


def env_seconds(environ: Mapping[str, str], key: str, default: float) -> float:
    """A number of seconds from ``environ[key]`` (``default`` when unset); a bad value names the variable."""
    value = environ.get(key)
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise LaunchError(f"{key}={value!r} is not a number of seconds; e.g. {key}={default:.0f}") from None


def add_script_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("user_script", help="the training script (a module name with --module)")
    parser.add_argument("user_args", nargs=argparse.REMAINDER, help="arguments passed on to the script")


class LauncherParser(argparse.ArgumentParser):
    """The launcher's parser; while ``probing``, an error raises ``ArgumentError`` instead of exiting (see
    :func:`deepshard.launcher.cli.parse_args`)."""

    probing = False

    def error(self, message: str) -> NoReturn:
        if self.probing:
            raise argparse.ArgumentError(None, message)
        super().error(message)


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        return int(sock.getsockname()[1])


def check_port_free(addr: str, port: int, flag: str = "--master_port") -> None:
    """Refuse a rendezvous ``port`` that another process already listens on (as the rank-0 store would
    bind it: with SO_REUSEADDR, so a port in TIME_WAIT after a restart is fine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((addr, port))
        except OSError as err:
            if err.errno not in (errno.EADDRINUSE, errno.EACCES):
                return  # not ours to judge (e.g. an address of another machine): the ranks will tell
            why = "is already in use" if err.errno == errno.EADDRINUSE else "needs privileges to bind"
            raise LaunchError(f"{flag} {port} {why} on {addr} (another job or process holds it); pass a free "
                              f"port, e.g. {flag} {free_port(addr)}") from err


def prepare_log_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".deepshard-write-test-{os.getpid()}")
        with open(probe, "w", encoding="utf-8"):
            pass
        os.remove(probe)
    except OSError as err:
        raise LaunchError(f"--enable_each_rank_log {path}: cannot write rank logs there "
                          f"({err.strerror or err}); pass a writable directory") from err
