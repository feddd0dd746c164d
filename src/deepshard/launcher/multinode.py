"""Start a multi-node job from one machine: one node agent per machine, through ssh, pdsh, mpirun or srun.
The command builders are pure (argument lists; nothing runs); :func:`run_agents` runs them under the supervisor
(:func:`supervise_ranks`), which starts them together, forwards their output and stops them together."""
from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from deepshard.launcher.hostfile import encode_world_info
from deepshard.launcher.options import LaunchError
from deepshard.launcher.output import Output, describe_exit, exit_status, pump, signal_group
from deepshard.utils.logging import logger

NODE_MODULE = "deepshard.launcher.node"
SSH_SETTLE_S = 25.0  # how long the ssh launcher lets the other nodes' agents stop on their own after one failed
PDSH_NODE_RANK = "@@DEEPSHARD_NODE_RANK@@"
"""The ``node_rank`` of a pdsh command's agent: :func:`plan_runners` puts pdsh's ``%n`` there."""


def node_agent_argv(world_token: str, node_rank: int | str | None, master_addr: str, master_port: int,
                    user_script: str, user_args: Sequence[str], *, max_restarts: int = 0,
                    process_flags: Sequence[str] = (), exit_on_stdin_close: bool = False,
                    python: str = sys.executable) -> list[str]:
    """The argv of one node's agent (``node_rank`` None where an MPI / Slurm runner numbers the agents); only
    node 0 prints failure reports, since every node's output reaches the launcher's terminal."""
    argv = [python, "-u", "-m", NODE_MODULE, "--world_info", world_token]
    argv += [] if node_rank is None else [f"--node_rank={node_rank}"]
    argv += ["--master_addr", master_addr, "--master_port", str(master_port)]
    argv += ["--max_restarts", str(max_restarts)] if max_restarts else []
    argv += ["--exit_on_stdin_close"] if exit_on_stdin_close else []
    return [*argv, "--report_on_node0", *process_flags, user_script, *user_args]


def remote_shell_command(argv: Sequence[str], exports: Mapping[str, str], cwd: str,
                         venv_script: str | None = None) -> str:
    """One POSIX shell line that sets up the environment on a remote machine and execs ``argv``."""
    parts = [f". {shlex.quote(venv_script)}"] if venv_script else []
    parts.append(f"cd {shlex.quote(cwd)}")
    if exports:
        parts.append("export " + " ".join(f"{name}={shlex.quote(value)}" for name, value in exports.items()))
    return " && ".join([*parts, "exec " + shlex.join(argv)])


HYDRA = "mpirun -n {n} -ppn 1 -hosts {hosts} EXTRA -genvlist=EXPORTS AGENT"
RUNNERS = {
    "ssh": "ssh EXTRA PORT {host} REMOTE",
    "pdsh": "pdsh -S -R ssh -f 1024 -w {hosts} EXTRA REMOTE",
    "openmpi": "mpirun -n {n} --host {hosts_one_slot} EXTRA -x=EXPORTS AGENT",
    "mpich": HYDRA, "impi": HYDRA, "mvapich": HYDRA,
    "slurm": "srun --nodes {n} --ntasks {n} --ntasks-per-node 1 --nodelist {hosts} --kill-on-bad-exit=1 --export=ALL "
             "EXTRA AGENT",
}
"""Each launcher's command line, word by word: ``{n}`` nodes, ``{host}`` (ssh: one per node), ``{hosts}`` joined
by commas (``{hosts_one_slot}``: ``w0:1,w1:1``), ``EXTRA`` the user's ``--launcher_args`` (ssh keeps the first value
of an option, so the user's come first), ``PORT`` ssh's ``-p``, ``EXPORTS`` the exported variables' names after
their flag (``-x`` before each, ``-genvlist`` before all), ``AGENT`` the node agent's argv, ``REMOTE`` the shell line
that runs it on the node. ``-S``: pdsh exits with the largest remote code; MPI and Slurm start one agent per host
(each reads its node rank from the runner's variables)."""


def runner_command(launcher: str, hosts: Sequence[str], agent: Sequence[str] = (), *, extra: Sequence[str] = (),
                   exports: Sequence[str] = (), port: int | None = None, remote: str = "") -> list[str]:
    words = {"EXTRA": list(extra), "PORT": [] if port is None else ["-p", str(port)], "AGENT": list(agent),
             "REMOTE": [remote], "-x=EXPORTS": [w for name in exports for w in ("-x", name)],
             "-genvlist=EXPORTS": ["-genvlist", ",".join(exports)] if exports else []}
    fields = {"n": len(hosts), "host": hosts[0], "hosts": ",".join(hosts),
              "hosts_one_slot": ",".join(f"{host}:1" for host in hosts)}
    return [out for word in RUNNERS[launcher].split() for out in words.get(word, [word.format(**fields)])]


def process_flags(args: argparse.Namespace) -> list[str]:
    flags = [f"--{name}" for name in ("module", "no_python", "no_local_rank", "bind_cores_to_rank", "quiet",
                                      "elastic_training") if getattr(args, name, False)]
    for name in ("min_elastic_nodes", "max_elastic_nodes"):
        if getattr(args, "elastic_training", False) and getattr(args, name) != -1:
            flags += [f"--{name}", str(getattr(args, name))]
    for name in ("enable_each_rank_log", "bind_core_list", "log_level"):
        if getattr(args, name):
            flags += [f"--{name}", str(getattr(args, name))]
    return flags


def plan_runners(args: argparse.Namespace, launcher: str, world: dict[str, list[int]], master_addr: str,
                 exports: Mapping[str, str], environ: Mapping[str, str], cwd: str,
                 python: str = sys.executable) -> list[ProcessSpec]:
    """The processes that start every node's agent: one ssh per node (its agent stops the job when ssh goes away),
    or one pdsh, mpirun or srun for all. ssh and pdsh set the exported variables in the remote shell line; mpirun
    and srun name them on the command line and carry their values in their environment (not shown by ``ps``)."""
    extra, hosts = shlex.split(args.launcher_args), list(world)

    def agent(node_rank: int | str | None, stdin: bool) -> list[str]:
        return node_agent_argv(encode_world_info(world), node_rank, master_addr, args.master_port, args.user_script,
                               args.user_args, max_restarts=args.max_restarts, process_flags=process_flags(args),
                               exit_on_stdin_close=stdin, python=python)

    if launcher == "ssh":
        return [ProcessSpec(rank, runner_command("ssh", [host], extra=extra, port=args.ssh_port, remote=
                                                 remote_shell_command(agent(rank, True), exports, cwd, args.venv_script)),
                            dict(environ), label=f"node {rank} (ssh {host})", stdin_pipe=True)
                for rank, host in enumerate(hosts)]
    if launcher == "pdsh":  # pdsh reads % in the line: doubled, then its %n is the node rank
        line = remote_shell_command(agent(PDSH_NODE_RANK, False), exports, cwd, args.venv_script)
        env = {**environ, "PDSH_RCMD_TYPE": "ssh"}
        if args.ssh_port is not None:
            env["PDSH_SSH_ARGS_APPEND"] = f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {args.ssh_port}".strip()
        cmd = runner_command("pdsh", hosts, extra=extra, remote=line.replace("%", "%%").replace(PDSH_NODE_RANK, "%n"))
        return [ProcessSpec(0, cmd, env, label=f"pdsh ({len(hosts)} nodes)")]
    cmd = runner_command(launcher, hosts, agent(None, False), extra=extra, exports=sorted(exports))
    ranks = sum(len(slots) for slots in world.values())
    return [ProcessSpec(0, cmd, {**environ, **exports}, label=f"{cmd[0]} ({len(hosts)} node agents, {ranks} ranks)")]


def check_ssh(hosts: Sequence[str], port: int | None, extra_args: Sequence[str],
              run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> None:
    """Check every host answers ``ssh HOST true`` without a password (in parallel, 15 s at most);
    ``LaunchError`` names the hosts that did not and what ssh said."""
    def probe(host: str) -> str | None:
        try:
            check = runner_command("ssh", [host], extra=[*extra_args, "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"],
                                   port=port, remote="true")  # never prompts for a password: fails
            done = run(check, stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{host}: {exc}"
        return None if done.returncode == 0 else f"{host}: {done.stderr.strip() or 'exit ' + str(done.returncode)}"

    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        problems = [p for p in pool.map(probe, hosts) if p]
    if problems:
        raise LaunchError("cannot ssh without a password to: " + "; ".join(problems) + ". Set up key-based "
                          "ssh to every node (ssh-copy-id), pass ssh options with --launcher_args / "
                          "--ssh_port, skip this check with --no_ssh_check, or run the same command on "
                          "each node with --no_ssh --node_rank N")


def run_agents(specs: list[ProcessSpec], on_started: Callable[[list[int]], None] | None) -> int:
    """Supervise the ssh / pdsh / mpirun / srun processes; the node agents report failures themselves."""
    code, failed = supervise_ranks(specs, on_started=on_started, settle_s=SSH_SETTLE_S,
                                   noun="node" if len(specs) > 1 else "runner")
    if failed is not None:
        print(f"deepshard: the job failed with exit code {code} ({failed.spec.label} ended first, with "
              f"{describe_exit(failed.proc.returncode)}); node 0's report above names the rank that failed",
              file=sys.stderr, flush=True)
    return code


# ---------------------------------------------------------------------- the runner processes

GRACE_S = 5.0
_POLL_S = 0.1


@dataclass(frozen=True)
class ProcessSpec:
    """One process the supervisor starts (an ssh, pdsh, mpirun or srun command); ``rank`` is its index, ``label``
    how reports name it (e.g. ``node 1 (ssh worker-1)``). ``stdin_pipe``: a stdin pipe the launcher holds open
    (ssh: the remote side sees end-of-file when the launcher dies); otherwise stdin is ``/dev/null``."""

    rank: int
    cmd: list[str]
    env: dict[str, str]
    label: str | None = None
    stdin_pipe: bool = False


@dataclass
class Child:
    """A started process: its spec, ``Popen`` (``returncode``: ``-N`` for signal N) and the end of its output."""

    spec: ProcessSpec
    proc: subprocess.Popen
    tail: bytearray = field(default_factory=bytearray)
    reader: threading.Thread | None = None

    def text(self) -> str:
        return bytes(self.tail).decode("utf-8", errors="replace").rstrip()


def _start(specs: Sequence[ProcessSpec], out: Output) -> list[Child]:
    children: list[Child] = []
    try:
        for spec in specs:
            proc = subprocess.Popen(spec.cmd, env=spec.env, stdin=subprocess.PIPE if spec.stdin_pipe else
                                    subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0,
                                    start_new_session=True)
            children.append(child := Child(spec, proc))
            child.reader = threading.Thread(target=pump, args=(proc.stdout, child, out, None, False),
                                            name=f"deepshard-out-{spec.rank}", daemon=True)
            child.reader.start()
    except OSError as exc:
        _stop(children, signal.SIGTERM)
        failed = specs[len(children)]
        raise RuntimeError(f"cannot start {failed.label or ' '.join(failed.cmd)}: {exc}") from exc
    return children


def _stop(children: Sequence[Child], sig: int, grace_s: float = GRACE_S) -> None:
    """``sig`` to the process groups of ``children`` still running (their stdin closed first); SIGKILL what is
    left after ``grace_s``; reap all and drain their output."""
    for child in children:
        if child.proc.stdin is not None:
            child.proc.stdin.close()  # unbuffered and never written to: nothing to flush, cannot fail
        if child.proc.poll() is None:
            signal_group(child.proc.pid, sig)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
    for child in children:
        if child.reader is not None:
            child.reader.join(2.0)


def _ended(running: list[Child]) -> list[Child]:
    """Remove and return the children of ``running`` that exited (their orphaned helpers get SIGTERM)."""
    ended = [child for child in running if child.proc.poll() is not None]
    for child in ended:
        running.remove(child)
        signal_group(child.proc.pid, signal.SIGTERM)
    return ended


def _supervise(children: list[Child], signals: list[int], settle_s: float, noun: str) -> tuple[int, Child | None]:
    running = list(children)
    while running:
        if signals:
            print(f"deepshard: received {signal.Signals(signals[0]).name}; forwarding it to {len(running)} running "
                  f"{noun}s", file=sys.stderr, flush=True)
            _stop(children, signals[0])
            return 128 + signals[0], None
        time.sleep(_POLL_S)
        failed = next((child for child in _ended(running) if child.proc.returncode != 0), None)
        if failed is not None:
            deadline = time.monotonic() + settle_s  # the others may end on their own (their agents heard of it)
            while running and time.monotonic() < deadline and not signals:
                time.sleep(_POLL_S)
                _ended(running)
            _stop(children, signal.SIGTERM)
            return exit_status(failed.proc.returncode), failed
    _stop(children, signal.SIGTERM, 0.0)
    return 0, None


def supervise_ranks(specs: Sequence[ProcessSpec], on_started: Callable[[list[int]], None] | None = None,
                    settle_s: float = 0.0, noun: str = "process") -> tuple[int, Child | None]:
    """Start one process per spec and supervise them until all succeed, one fails (the others get
    ``settle_s`` seconds to end on their own, then are stopped), or the launcher gets SIGINT/SIGTERM
    (forwarded); every process is reaped. ``on_started`` gets the pids once all started. Returns the exit
    status and the process that failed first (None if none did)."""
    signals: list[int] = []
    saved: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        saved = {sig: signal.signal(sig, lambda signum, frame: signals.append(signum))
                 for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            children = _start(specs, Output())
        except RuntimeError as exc:
            print(f"deepshard: {exc}", file=sys.stderr, flush=True)
            return 1, None
        logger.info("started %d %ss: %s", len(children), noun,
                    ", ".join(f"{c.spec.label or noun + ' ' + str(c.spec.rank)} pid {c.proc.pid}" for c in children))
        if on_started is not None:
            on_started([child.proc.pid for child in children])
        try:
            return _supervise(children, signals, settle_s, noun)
        except BaseException:
            _stop(children, signal.SIGKILL, grace_s=0.0)
            raise
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)
