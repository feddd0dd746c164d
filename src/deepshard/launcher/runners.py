"""Commands that start a multi-node job: ssh / pdsh (one node agent per machine) and mpirun / srun
(one process per rank). Pure functions: they build argument lists, nothing runs here.

* ssh and pdsh start :mod:`deepshard.launcher.node` on every machine with the same arguments except
  ``--node_rank``; the remote shell command is ``[. VENV &&] cd CWD && export NAME=VALUE ... &&
  exec python -u -m deepshard.launcher.node ...``. pdsh substitutes ``%n`` with each host's index in
  its ``-w`` list (which keeps our order), so one pdsh command serves every node; a literal ``%`` is
  written ``%%`` for pdsh.
* OpenMPI (``mpirun -n N --host h1:n1,h2:n2 -x NAME ...``), MPICH / Intel MPI / MVAPICH (Hydra:
  ``mpirun -n N -ppn P -hosts h1,h2 -genvlist A,B ...``) and Slurm (``srun --nodes K --ntasks N
  --ntasks-per-node P --nodelist h1,h2 --kill-on-bad-exit=1 --export=ALL ...``) start the user's
  script once per rank; each rank finds its rank and world size in the MPI or Slurm environment
  (:func:`deepshard.init_distributed` reads it). Exported variables are named on the command line
  and their values travel in the runner's environment, so secrets from an env file do not show up in
  ``ps``.
"""
from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping, Sequence

NODE_MODULE = "deepshard.launcher.node"
PDSH_FANOUT = 1024
PDSH_NODE_RANK = "%n"
_PLACEHOLDER = "@@DEEPSHARD_NODE_RANK@@"


def node_agent_argv(world_token: str, node_rank: int | str, master_addr: str, master_port: int,
                    user_script: str, user_args: Sequence[str], *, max_restarts: int = 0,
                    process_flags: Sequence[str] = (), exit_on_stdin_close: bool = False,
                    python: str = sys.executable) -> list[str]:
    """The argv of one node's agent started by ssh / pdsh (``node_rank`` may be pdsh's ``%n``); only
    node 0 prints failure reports, since every node's output reaches the launcher's terminal."""
    argv = [python, "-u", "-m", NODE_MODULE, "--world_info", world_token, f"--node_rank={node_rank}",
            "--master_addr", master_addr, "--master_port", str(master_port)]
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


def _check_contiguous(world: Mapping[str, Sequence[int]], launcher: str) -> None:
    for host, slots in world.items():
        if list(slots) != list(range(len(slots))):
            raise ValueError(
                f"--launcher {launcher} starts ranks 0..n-1 on each host and cannot pick slots, but host "
                f"{host!r} has slots {list(slots)} selected; select whole hosts or --num_gpus N, or use "
                "the ssh / --no_ssh launch, which can")


def _uniform_count(world: Mapping[str, Sequence[int]], launcher: str) -> int:
    counts = {host: len(slots) for host, slots in world.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"--launcher {launcher} starts the same number of ranks on every host, but the "
                         f"selection has {counts}; give every host the same slots (e.g. --num_gpus "
                         f"{min(counts.values())})")
    return next(iter(counts.values()))


def openmpi_command(world: Mapping[str, Sequence[int]], rank_argv: Sequence[str],
                    export_names: Sequence[str], extra_args: Sequence[str] = ()) -> list[str]:
    """``mpirun -n N --host h1:n1,h2:n2 [EXTRA] -x NAME ... python -u script args`` (OpenMPI fills
    the hosts in order, so ranks follow the hostfile)."""
    _check_contiguous(world, "openmpi")
    total = sum(len(slots) for slots in world.values())
    hosts = ",".join(f"{host}:{len(slots)}" for host, slots in world.items())
    cmd = ["mpirun", "-n", str(total), "--host", hosts, *extra_args]
    for name in export_names:
        cmd += ["-x", name]
    return cmd + list(rank_argv)


def hydra_command(world: Mapping[str, Sequence[int]], rank_argv: Sequence[str],
                  export_names: Sequence[str], extra_args: Sequence[str] = (),
                  launcher: str = "mpich") -> list[str]:
    """MPICH / Intel MPI / MVAPICH (Hydra process manager): ``mpirun -n N -ppn P -hosts h1,h2 [EXTRA]
    -genvlist A,B python -u script args``."""
    _check_contiguous(world, launcher)
    per_node = _uniform_count(world, launcher)
    cmd = ["mpirun", "-n", str(per_node * len(world)), "-ppn", str(per_node), "-hosts", ",".join(world),
           *extra_args]
    if export_names:
        cmd += ["-genvlist", ",".join(export_names)]
    return cmd + list(rank_argv)


def slurm_command(world: Mapping[str, Sequence[int]], rank_argv: Sequence[str],
                  extra_args: Sequence[str] = ()) -> list[str]:
    """``srun --nodes K --ntasks N --ntasks-per-node P --nodelist h1,h2 --kill-on-bad-exit=1
    --export=ALL [EXTRA] python -u script args`` (the exported variables are in srun's environment)."""
    _check_contiguous(world, "slurm")
    per_node = _uniform_count(world, "slurm")
    return ["srun", "--nodes", str(len(world)), "--ntasks", str(per_node * len(world)),
            "--ntasks-per-node", str(per_node), "--nodelist", ",".join(world), "--kill-on-bad-exit=1",
            "--export=ALL", *extra_args, *rank_argv]
