"""Start a multi-node job from one machine: one node agent per machine, through ssh, pdsh, mpirun or srun.
The command builders are pure (argument lists; nothing runs); :func:`run_agents` runs them."""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from deepshard.launcher.hostfile import encode_world_info
from deepshard.launcher.options import LaunchError
from deepshard.launcher.supervisor import ProcessSpec, supervise_ranks

NODE_MODULE = "deepshard.launcher.node"
MPI_LAUNCHERS = ("openmpi", "mpich", "impi", "mvapich", "slurm")
SSH_SETTLE_S = 25.0  # how long the ssh launcher lets the other nodes' agents stop on their own after one failed
PDSH_NODE_RANK = "@@DEEPSHARD_NODE_RANK@@"
"""The ``node_rank`` of a pdsh command's agent: :func:`pdsh_remote_command` puts pdsh's ``%n`` there."""


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


def ssh_command(host: str, remote_command: str, port: int | None = None,
                extra_args: Sequence[str] = ()) -> list[str]:
    """``ssh [EXTRA] [-p PORT] HOST 'COMMAND'`` (the user's ``--launcher_args`` first: ssh keeps the first value
    of an option)."""
    return ["ssh", *extra_args, *(["-p", str(port)] if port is not None else []), host, remote_command]


def ssh_check_command(host: str, port: int | None = None, extra_args: Sequence[str] = ()) -> list[str]:
    """``ssh ... -o BatchMode=yes -o ConnectTimeout=10 HOST true``: never prompts for a password (fails)."""
    return ssh_command(host, "true", port, [*extra_args, "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"])


def pdsh_remote_command(argv: Sequence[str], exports: Mapping[str, str], cwd: str,
                        venv_script: str | None = None) -> str:
    """The remote shell line for pdsh: every ``%`` doubled, then the node-rank placeholder -> ``%n``."""
    line = remote_shell_command(argv, exports, cwd, venv_script)
    return line.replace("%", "%%").replace(PDSH_NODE_RANK, "%n")


def pdsh_command(hosts: Sequence[str], remote_command: str, extra_args: Sequence[str] = ()) -> list[str]:
    """``pdsh -S -R ssh -f 1024 -w h1,h2 [EXTRA] 'COMMAND'`` (``-S``: pdsh exits with the largest remote code)."""
    return ["pdsh", "-S", "-R", "ssh", "-f", "1024", "-w", ",".join(hosts), *extra_args, remote_command]


def pdsh_environment(base_env: Mapping[str, str], ssh_port: int | None) -> dict[str, str]:
    """pdsh's environment: ``PDSH_RCMD_TYPE=ssh``, the ssh port added to ``PDSH_SSH_ARGS_APPEND``."""
    env = {**base_env, "PDSH_RCMD_TYPE": "ssh"}
    if ssh_port is not None:
        env["PDSH_SSH_ARGS_APPEND"] = f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {ssh_port}".strip()
    return env


def openmpi_command(world: Mapping[str, Sequence[int]], agent_argv: Sequence[str],
                    export_names: Sequence[str], extra_args: Sequence[str] = ()) -> list[str]:
    """``mpirun -n K --host h1:1,h2:1 [EXTRA] -x NAME ... AGENT``: one agent per host, in hostfile order
    (each reads its node rank from ``OMPI_COMM_WORLD_RANK``)."""
    exports = [word for name in export_names for word in ("-x", name)]
    return ["mpirun", "-n", str(len(world)), "--host", ",".join(f"{host}:1" for host in world), *extra_args,
            *exports, *agent_argv]


def hydra_command(world: Mapping[str, Sequence[int]], agent_argv: Sequence[str],
                  export_names: Sequence[str], extra_args: Sequence[str] = ()) -> list[str]:
    """MPICH / Intel MPI / MVAPICH (Hydra): ``mpirun -n K -ppn 1 -hosts h1,h2 [EXTRA] -genvlist A,B AGENT``
    (one agent per host; ``PMI_RANK``)."""
    exports = ["-genvlist", ",".join(export_names)] if export_names else []
    return ["mpirun", "-n", str(len(world)), "-ppn", "1", "-hosts", ",".join(world), *extra_args, *exports,
            *agent_argv]


def slurm_command(world: Mapping[str, Sequence[int]], agent_argv: Sequence[str],
                  extra_args: Sequence[str] = ()) -> list[str]:
    """``srun --nodes K --ntasks K --ntasks-per-node 1 --nodelist h1,h2 --kill-on-bad-exit=1 --export=ALL [EXTRA]
    AGENT`` (one agent per node; the exported variables are in srun's environment)."""
    return ["srun", "--nodes", str(len(world)), "--ntasks", str(len(world)), "--ntasks-per-node", "1",
            "--nodelist", ",".join(world), "--kill-on-bad-exit=1", "--export=ALL", *extra_args, *agent_argv]


def process_flags(args: argparse.Namespace) -> list[str]:
    """The launcher flags that tell a node agent how to run each rank."""
    flags = [f"--{name}" for name in ("module", "no_python", "no_local_rank", "bind_cores_to_rank", "quiet",
                                      "elastic_training") if getattr(args, name, False)]
    for name in ("min_elastic_nodes", "max_elastic_nodes"):
        if getattr(args, "elastic_training", False) and getattr(args, name) != -1:
            flags += [f"--{name}", str(getattr(args, name))]
    for name in ("enable_each_rank_log", "bind_core_list", "log_level"):
        if getattr(args, name):
            flags += [f"--{name}", str(getattr(args, name))]
    return flags


def _agent_argv(args: argparse.Namespace, world: dict[str, list[int]], node_rank: int | str | None,
                master_addr: str, exit_on_stdin_close: bool, python: str) -> list[str]:
    return node_agent_argv(encode_world_info(world), node_rank, master_addr, args.master_port, args.user_script,
                           args.user_args, max_restarts=args.max_restarts, process_flags=process_flags(args),
                           exit_on_stdin_close=exit_on_stdin_close, python=python)


def plan_ssh(args: argparse.Namespace, world: dict[str, list[int]], master_addr: str, exports: Mapping[str, str],
             environ: Mapping[str, str], cwd: str, python: str = sys.executable) -> list[ProcessSpec]:
    """One ssh process per node, each starting that node's agent (which stops the job when ssh goes away)."""
    extra, specs = shlex.split(args.launcher_args), []
    for node_rank, host in enumerate(world):
        argv = _agent_argv(args, world, node_rank, master_addr, True, python)
        cmd = ssh_command(host, remote_shell_command(argv, exports, cwd, args.venv_script), args.ssh_port, extra)
        specs.append(ProcessSpec(node_rank, cmd, dict(environ), label=f"node {node_rank} (ssh {host})",
                                 stdin_pipe=True))
    return specs


def plan_pdsh(args: argparse.Namespace, world: dict[str, list[int]], master_addr: str, exports: Mapping[str, str],
              environ: Mapping[str, str], cwd: str, python: str = sys.executable) -> ProcessSpec:
    """One pdsh process starting every node's agent."""
    argv = _agent_argv(args, world, PDSH_NODE_RANK, master_addr, False, python)
    cmd = pdsh_command(list(world), pdsh_remote_command(argv, exports, cwd, args.venv_script),
                       shlex.split(args.launcher_args))
    return ProcessSpec(0, cmd, pdsh_environment(environ, args.ssh_port), label=f"pdsh ({len(world)} nodes)")


def plan_mpi(args: argparse.Namespace, launcher: str, world: dict[str, list[int]], master_addr: str,
             exports: Mapping[str, str], environ: Mapping[str, str], python: str = sys.executable) -> ProcessSpec:
    """One mpirun / srun process starting a node agent on every host; the agents number themselves from the
    runner's variables. The exported variables are named on the command line, their values travel in the
    runner's environment (so they do not show in ``ps``)."""
    argv, extra = _agent_argv(args, world, None, master_addr, False, python), shlex.split(args.launcher_args)
    if launcher == "slurm":
        cmd = slurm_command(world, argv, extra)
    else:
        cmd = (openmpi_command if launcher == "openmpi" else hydra_command)(world, argv, sorted(exports), extra)
    ranks = sum(len(slots) for slots in world.values())
    return ProcessSpec(0, cmd, {**environ, **exports}, label=f"{cmd[0]} ({len(world)} node agents, {ranks} ranks)")


def check_ssh(hosts: Sequence[str], port: int | None, extra_args: Sequence[str],
              run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> None:
    """Check every host answers ``ssh HOST true`` without a password (in parallel, 15 s at most);
    ``LaunchError`` names the hosts that did not and what ssh said."""
    def probe(host: str) -> str | None:
        try:
            done = run(ssh_check_command(host, port, extra_args), stdin=subprocess.DEVNULL, capture_output=True,
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
    result = supervise_ranks(specs, on_started=on_started, settle_s=SSH_SETTLE_S,
                             noun="node" if len(specs) > 1 else "runner")
    if result.failure is not None:
        print(f"deepshard: the job failed with exit code {result.exit_code} ({result.failure.label} ended "
              f"first, with {result.failure.describe_exit()}); node 0's report above names the rank "
              "that failed", file=sys.stderr, flush=True)
    return result.exit_code
