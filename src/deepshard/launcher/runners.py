"""Commands that start a multi-node job: one node agent per machine, through ssh, pdsh, mpirun or srun.
Pure functions: they build argument lists, nothing runs here."""
from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping, Sequence

NODE_MODULE = "deepshard.launcher.node"
PDSH_FANOUT = 1024
PDSH_NODE_RANK = "%n"
_PLACEHOLDER = "@@DEEPSHARD_NODE_RANK@@"


def node_agent_argv(world_token: str, node_rank: int | str | None, master_addr: str, master_port: int,
                    user_script: str, user_args: Sequence[str], *, max_restarts: int = 0,
                    process_flags: Sequence[str] = (), exit_on_stdin_close: bool = False,
                    python: str = sys.executable) -> list[str]:
    """The argv of one node's agent (``node_rank`` may be pdsh's ``%n``, or None where an MPI / Slurm runner
    numbers the agents); only node 0 prints failure reports, since every node's output reaches the
    launcher's terminal."""
    argv = [python, "-u", "-m", NODE_MODULE, "--world_info", world_token]
    if node_rank is not None:
        argv.append(f"--node_rank={node_rank}")
    argv += ["--master_addr", master_addr, "--master_port", str(master_port)]
    if max_restarts:
        argv += ["--max_restarts", str(max_restarts)]
    if exit_on_stdin_close:
        argv.append("--exit_on_stdin_close")
    argv.append("--report_on_node0")
    return argv + list(process_flags) + [user_script, *user_args]


def remote_shell_command(argv: Sequence[str], exports: Mapping[str, str], cwd: str,
                         venv_script: str | None = None) -> str:
    """One POSIX shell line that sets up the environment on a remote machine and execs ``argv``."""
    parts = []
    if venv_script:
        parts.append(f". {shlex.quote(venv_script)}")
    parts.append(f"cd {shlex.quote(cwd)}")
    if exports:
        parts.append("export " + " ".join(f"{name}={shlex.quote(value)}" for name, value in exports.items()))
    parts.append("exec " + shlex.join(argv))
    return " && ".join(parts)


def ssh_command(host: str, remote_command: str, port: int | None = None,
                extra_args: Sequence[str] = ()) -> list[str]:
    """``ssh [EXTRA] [-p PORT] HOST 'COMMAND'`` (the user's ``--launcher_args`` come first, so their
    ``-o`` options win over anything ssh reads later)."""
    cmd = ["ssh", *extra_args]
    if port is not None:
        cmd += ["-p", str(port)]
    return cmd + [host, remote_command]


def ssh_check_command(host: str, port: int | None = None, extra_args: Sequence[str] = ()) -> list[str]:
    """A quick reachability check: ``ssh ... -o BatchMode=yes -o ConnectTimeout=10 HOST true``; never
    prompts for a password (it fails instead)."""
    return ssh_command(host, "true", port, [*extra_args, "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"])


def pdsh_remote_command(argv_with_placeholder: Sequence[str], exports: Mapping[str, str], cwd: str,
                        venv_script: str | None = None) -> str:
    """The remote shell line for pdsh: every ``%`` doubled, then the node-rank placeholder -> ``%n``."""
    line = remote_shell_command(argv_with_placeholder, exports, cwd, venv_script)
    return line.replace("%", "%%").replace(_PLACEHOLDER, PDSH_NODE_RANK)


def pdsh_node_rank_placeholder() -> str:
    """The value to pass as ``node_rank`` to :func:`node_agent_argv` for a pdsh command."""
    return _PLACEHOLDER


def pdsh_command(hosts: Sequence[str], remote_command: str, extra_args: Sequence[str] = ()) -> list[str]:
    """``pdsh -S -R ssh -f 1024 -w h1,h2 [EXTRA] 'COMMAND'``: ``-S`` makes pdsh exit with the largest
    remote exit code."""
    return ["pdsh", "-S", "-R", "ssh", "-f", str(PDSH_FANOUT), "-w", ",".join(hosts), *extra_args,
            remote_command]


def pdsh_environment(base_env: Mapping[str, str], ssh_port: int | None) -> dict[str, str]:
    """pdsh's own environment: ``PDSH_RCMD_TYPE=ssh`` and the ssh port in ``PDSH_SSH_ARGS_APPEND``
    (added to what the user already put there)."""
    env = dict(base_env)
    env["PDSH_RCMD_TYPE"] = "ssh"
    if ssh_port is not None:
        env["PDSH_SSH_ARGS_APPEND"] = f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {ssh_port}".strip()
    return env


def openmpi_command(world: Mapping[str, Sequence[int]], agent_argv: Sequence[str],
                    export_names: Sequence[str], extra_args: Sequence[str] = ()) -> list[str]:
    """``mpirun -n K --host h1:1,h2:1 [EXTRA] -x NAME ... python -u -m deepshard.launcher.node ...``: one node
    agent per host, in hostfile order (each reads its node rank from ``OMPI_COMM_WORLD_RANK``)."""
    hosts = ",".join(f"{host}:1" for host in world)
    cmd = ["mpirun", "-n", str(len(world)), "--host", hosts, *extra_args]
    for name in export_names:
        cmd += ["-x", name]
    return cmd + list(agent_argv)


def hydra_command(world: Mapping[str, Sequence[int]], agent_argv: Sequence[str],
                  export_names: Sequence[str], extra_args: Sequence[str] = ()) -> list[str]:
    """MPICH / Intel MPI / MVAPICH (Hydra process manager): ``mpirun -n K -ppn 1 -hosts h1,h2 [EXTRA]
    -genvlist A,B python -u -m deepshard.launcher.node ...`` (one agent per host; ``PMI_RANK``)."""
    cmd = ["mpirun", "-n", str(len(world)), "-ppn", "1", "-hosts", ",".join(world), *extra_args]
    if export_names:
        cmd += ["-genvlist", ",".join(export_names)]
    return cmd + list(agent_argv)


def slurm_command(world: Mapping[str, Sequence[int]], agent_argv: Sequence[str],
                  extra_args: Sequence[str] = ()) -> list[str]:
    """``srun --nodes K --ntasks K --ntasks-per-node 1 --nodelist h1,h2 --kill-on-bad-exit=1 --export=ALL
    [EXTRA] python -u -m deepshard.launcher.node ...`` (one agent per node; the exported variables are in
    srun's environment)."""
    return ["srun", "--nodes", str(len(world)), "--ntasks", str(len(world)), "--ntasks-per-node", "1",
            "--nodelist", ",".join(world), "--kill-on-bad-exit=1", "--export=ALL", *extra_args, *agent_argv]
