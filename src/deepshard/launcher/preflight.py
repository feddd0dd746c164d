"""Checks the launcher makes before a rank starts, so a bad value is a one-line error naming the flag and
the fix instead of a traceback from a rank: port numbers, a port already taken, an unwritable log
directory. (A hostfile that is not text is refused by :func:`deepshard.launcher.hostfile.read_hostfile`.)"""
from __future__ import annotations

import errno
import os
import socket

from deepshard.launcher.options import LaunchError


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
            try:
                suggestion = f", e.g. {flag} {free_port(addr)}"
            except OSError:
                suggestion = ""
            raise LaunchError(f"{flag} {port} {why} on {addr} (another job or process holds it); pass a free "
                              f"port{suggestion}") from err


def prepare_log_dir(path: str) -> None:
    """Create ``--enable_each_rank_log``'s directory and check it is writable."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".deepshard-write-test-{os.getpid()}")
        with open(probe, "w", encoding="utf-8"):
            pass
        os.remove(probe)
    except OSError as err:
        raise LaunchError(f"--enable_each_rank_log {path}: cannot write rank logs there "
                          f"({err.strerror or err}); pass a writable directory") from err
