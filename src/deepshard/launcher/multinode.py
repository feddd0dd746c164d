"""Start a multi-node job from one machine: ssh / pdsh (a node agent per machine) or mpirun / srun."""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from deepshard.launcher.hostfile import encode_world_info
from deepshard.launcher.options import LaunchError
from deepshard.launcher.runners import (
    hydra_command,
    node_agent_argv,
    openmpi_command,
    pdsh_command,
    pdsh_environment,
    pdsh_node_rank_placeholder,
    pdsh_remote_command,
    remote_shell_command,
    slurm_command,
    ssh_check_command,
    ssh_command,
)
from deepshard.launcher.supervisor import ProcessSpec, supervise_ranks

MPI_LAUNCHERS = ("openmpi", "mpich", "impi", "mvapich", "slurm")
# How long the ssh launcher lets the other nodes' agents stop on their own after one failed.
SSH_SETTLE_S = 25.0


def process_flags(args: argparse.Namespace) -> list[str]:
    """The launcher flags that tell a node agent how to run each rank."""
    flags = [f"--{name}" for name in ("module", "no_python", "no_local_rank", "bind_cores_to_rank", "quiet",
                                      "elastic_training") if getattr(args, name, False)]
    for name in ("min_elastic_nodes", "max_elastic_nodes"):
        if getattr(args, "elastic_training", False) and getattr(args, name) != -1:
            flags += [f"--{name}", str(getattr(args, name))]
    for name in ("enable_each_rank_log", "bind_core_list", "log_level"):
        value = getattr(args, name)
        if value:
            flags += [f"--{name}", str(value)]
    return flags


def _agent_argv(args: argparse.Namespace, world: dict[str, list[int]], node_rank: int | str | None,
                master_addr: str, exit_on_stdin_close: bool, python: str) -> list[str]:
    return node_agent_argv(encode_world_info(world), node_rank, master_addr, args.master_port,
                           args.user_script, args.user_args, max_restarts=args.max_restarts,
                           process_flags=process_flags(args), exit_on_stdin_close=exit_on_stdin_close,
                           python=python)


def plan_ssh(args: argparse.Namespace, world: dict[str, list[int]], master_addr: str,
             exports: Mapping[str, str], environ: Mapping[str, str], cwd: str,
             python: str = sys.executable) -> list[ProcessSpec]:
    """One ssh process per node, each starting that node's agent (pure)."""
    extra = shlex.split(args.launcher_args)
    specs = []
    for node_rank, host in enumerate(world):
        argv = _agent_argv(args, world, node_rank, master_addr, True, python)
        remote = remote_shell_command(argv, exports, cwd, args.venv_script)
        cmd = ssh_command(host, remote, args.ssh_port, extra)
        specs.append(ProcessSpec(node_rank, cmd, dict(environ), label=f"node {node_rank} (ssh {host})",
                              stdin_pipe=True))
    return specs


def plan_pdsh(args: argparse.Namespace, world: dict[str, list[int]], master_addr: str,
              exports: Mapping[str, str], environ: Mapping[str, str], cwd: str,
              python: str = sys.executable) -> ProcessSpec:
    """One pdsh process starting every node's agent (pure)."""
    argv = _agent_argv(args, world, pdsh_node_rank_placeholder(), master_addr, False, python)
    remote = pdsh_remote_command(argv, exports, cwd, args.venv_script)
    cmd = pdsh_command(list(world), remote, shlex.split(args.launcher_args))
    return ProcessSpec(0, cmd, pdsh_environment(environ, args.ssh_port), label=f"pdsh ({len(world)} nodes)")


def plan_mpi(args: argparse.Namespace, launcher: str, world: dict[str, list[int]], master_addr: str,
             exports: Mapping[str, str], environ: Mapping[str, str], python: str = sys.executable) -> ProcessSpec:
    """One mpirun / srun process starting a node agent on every host (pure); the agents number themselves
    from the runner's variables and handle failures and restarts. The exported variables' values travel in
    the runner's environment."""
    names = sorted(exports)
    argv = _agent_argv(args, world, None, master_addr, False, python)
    extra = shlex.split(args.launcher_args)
    if launcher == "openmpi":
        cmd = openmpi_command(world, argv, names, extra)
    elif launcher == "slurm":
        cmd = slurm_command(world, argv, extra)
    else:
        cmd = hydra_command(world, argv, names, extra)
    ranks = sum(len(slots) for slots in world.values())
    return ProcessSpec(0, cmd, {**environ, **exports},
                    label=f"{cmd[0]} ({len(world)} node agents, {ranks} ranks)")


def check_ssh(hosts: Sequence[str], port: int | None, extra_args: Sequence[str],
              run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> None:
    """Check every host answers ``ssh HOST true`` without a password (in parallel, 15 s at most);
    ``LaunchError`` names the hosts that did not and what ssh said."""
    def probe(host: str) -> str | None:
        cmd = ssh_check_command(host, port, extra_args)
        try:
            done = run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=15)
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
    """Supervise the ssh / pdsh processes; the node agents report failures themselves."""
    noun = "node" if len(specs) > 1 else "runner"
    result = supervise_ranks(specs, on_started=on_started, settle_s=SSH_SETTLE_S, noun=noun)
    if result.failure is not None:
        print(f"deepshard: the job failed with exit code {result.exit_code} ({result.failure.label} ended "
              f"first, with {result.failure.describe_exit()}); node 0's report above names the rank "
              "that failed", file=sys.stderr, flush=True)
    return result.exit_code
