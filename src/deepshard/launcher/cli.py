"""The ``deepshard`` command: DeepSpeed's launcher flags, on one machine or many."""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import socket
import sys
from collections.abc import Callable, Mapping, Sequence

from deepshard.commands import DefaultsHelpFormatter, add_command_list, find_command, run_command
from deepshard.compat.run import real_deepspeed, route_ranks
from deepshard.launcher import multinode, node, report
from deepshard.launcher.envfile import env_file_paths, job_exports, read_env_files
from deepshard.launcher.hostfile import parse_node_spec, read_hostfile, resolve_resources
from deepshard.launcher.local import AgentJob, detect_cuda_devices
from deepshard.launcher.options import (
    DEFAULT_HOSTFILE,
    DEFAULT_MASTER_PORT,
    PID_FILE_DIR,
    LaunchError,
    LauncherParser,
    add_multi_node_args,
    add_process_args,
    add_resource_args,
    add_script_args,
    check_port_free,
    free_port,
    prepare_log_dir,
)
from deepshard.utils.logging import logger
from deepshard.utils.progress import PROGRESS_ENV

LOCAL_HOST = "localhost"
Runner = Callable[[Callable[[list[int]], None] | None], int]  # runs the planned launch; gets the pids callback

__all__ = ["DEFAULT_HOSTFILE", "DEFAULT_MASTER_PORT", "LaunchError", "build_parser", "launch", "launch_mode", "main",
           "parse_args", "plan_launch", "select_nodes"]


def build_parser() -> LauncherParser:
    from deepshard import __version__

    parser = LauncherParser(
        prog="deepshard", formatter_class=DefaultsHelpFormatter,
        description="Launch a training script on this machine or on the hosts of a hostfile.",
        epilog="example: deepshard --num_gpus 2 train.py --deepspeed --deepspeed_config ds_config.json")
    parser.add_argument("--version", action="version", version=f"deepshard {__version__}")
    for add in (add_resource_args, add_multi_node_args, add_process_args, add_script_args):
        add(parser)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The launcher's command line parsed (``sys.argv[1:]`` when None). Before the script a unique prefix of a
    flag is that flag (argparse's own matching, as in DeepSpeed's parser); every word after the script is the
    script's. argparse refuses a word it finds ambiguous anywhere (``train.py --h 3``: ``--help`` or
    ``--hostfile``?): when the words before it already name the script, it and the rest go to the script."""
    words, parser = list(sys.argv[1:] if argv is None else argv), build_parser()
    parser.probing = True
    try:
        return parser.parse_args(words)
    except argparse.ArgumentError as exc:
        word = exc.message.partition("ambiguous option: ")[2].partition(" could match")[0]
        cut = words.index(word) if word in words else 0
        try:
            head = parser.parse_args(words[:cut]) if cut else None
        except argparse.ArgumentError:
            head = None
        if head is not None:
            return argparse.Namespace(**{**vars(head), "user_args": [*head.user_args, *words[cut:]]})
        parser.probing = False
        parser.error(exc.message)


def local_hostnames() -> set[str]:
    name = socket.gethostname()
    return {LOCAL_HOST, "127.0.0.1", name, name.split(".")[0]}


def _localize_spec(spec: str, names: set[str]) -> str:
    """Rewrite this machine's aliases in a node spec to ``localhost`` (runs without a hostfile)."""
    parts = [(LOCAL_HOST if host in names else host, slots) for host, slots in parse_node_spec(spec).items()]
    return "@".join(host if slots is None else f"{host}:{','.join(map(str, slots))}" for host, slots in parts)


def _resources(args: argparse.Namespace, hostfile: dict[str, int] | None, cuda_devices: list[str] | None,
               names: set[str]) -> tuple[dict[str, int], str, str]:
    """Hosts and slot counts to select from, and the include/exclude specs to apply. Without a hostfile on CPU a
    slot is a process: ``--num_gpus`` of them, else as many as ``--include`` names, else one."""
    if hostfile is not None:
        return dict(hostfile), args.include, args.exclude
    if args.num_nodes > 1:
        raise LaunchError(f"--num_nodes {args.num_nodes} needs a hostfile listing the nodes, but "
                          f"{args.hostfile} does not exist; pass -H/--hostfile or drop --num_nodes")
    include = _localize_spec(args.include, names) if args.include else ""
    exclude = _localize_spec(args.exclude, names) if args.exclude else ""
    if cuda_devices is not None:
        return {LOCAL_HOST: len(cuda_devices)}, include, exclude
    wanted = parse_node_spec(include).get(LOCAL_HOST) if include else None
    slots = args.num_gpus if args.num_gpus > 0 else max(wanted) + 1 if wanted else 1
    return {LOCAL_HOST: slots}, include, exclude


def _check_supported(args: argparse.Namespace) -> None:
    if args.autotuning:
        raise LaunchError(f"--autotuning {args.autotuning} is run by deepshard.autotuning.tuner (the "
                          "`deepshard` command), not by a node plan")
    if (args.min_elastic_nodes != -1 or args.max_elastic_nodes != -1) and not args.elastic_training:
        raise LaunchError("--min_elastic_nodes / --max_elastic_nodes apply with --elastic_training; add it")
    if args.module and args.no_python:
        raise LaunchError("--module and --no_python cannot be combined; pick one")
    if args.max_restarts < 0:
        raise LaunchError(f"--max_restarts {args.max_restarts} must be >= 0")


def select_nodes(args: argparse.Namespace, hostfile: dict[str, int] | None,
                 cuda_devices: list[str] | None, names: set[str]) -> dict[str, list[int]]:
    """The hosts and slots this launch uses, ``{host: [slot, ...]}`` in hostfile order (pure)."""
    _check_supported(args)
    resources, include, exclude = _resources(args, hostfile, cuda_devices, names)
    try:
        return resolve_resources(resources, include, exclude, args.num_nodes, args.num_gpus)
    except ValueError as exc:
        raise LaunchError(str(exc)) from exc


def launch_mode(args: argparse.Namespace, active: dict[str, list[int]], pdsh_available: bool) -> str:
    """``local`` (one machine), ``no_ssh``, ``ssh``, ``pdsh``, or the MPI / Slurm launcher's name."""
    if len(active) == 1 and not args.force_multi:
        if args.no_ssh and args.node_rank > 0:
            raise LaunchError(f"--node_rank {args.node_rank} with a one-node selection ({', '.join(active)}); "
                              "node ranks run 0..nodes-1")
        return "local"
    if args.no_ssh:
        if args.node_rank < 0:
            raise LaunchError(f"--no_ssh needs --node_rank N on each machine: the selection has "
                              f"{len(active)} nodes ({', '.join(active)}), numbered 0..{len(active) - 1} "
                              "in hostfile order")
        return "no_ssh"
    if args.node_rank >= 0:
        raise LaunchError(f"--node_rank {args.node_rank} only applies with --no_ssh (run the same command on "
                          "every node); without it the launcher starts every node itself")
    if args.launcher == "pdsh" and not pdsh_available:
        logger.info("pdsh is not installed; starting the nodes with ssh")
        return "ssh"
    return args.launcher


def local_job(args: argparse.Namespace, hostfile: dict[str, int] | None, cuda_devices: list[str] | None,
              names: set[str]) -> node.NodeJob:
    """A one-machine launch as a one-node job for torch's agent (a selection of several nodes raises)."""
    active = select_nodes(args, hostfile, cuda_devices, names)
    if args.force_multi:
        raise LaunchError("--force_multi asks for a multi-node launch, not a single-machine plan")
    if len(active) > 1:
        raise LaunchError(f"this selection spans {len(active)} nodes ({', '.join(active)}): a multi-node "
                          "launch (see launch_mode), not a single-machine plan")
    (host, slots), = active.items()
    if host not in names:
        logger.warning("the selection names only host %r, which is not this machine (%s); running its %d slots "
                       "here, as DeepSpeed does for a single node", host, socket.gethostname(), len(slots))
    for flag in ("launcher_args", "no_ssh_check", "ssh_port", "venv_script"):
        if getattr(args, flag) not in (None, "", False):
            logger.info("--%s only matters for multi-node launch; ignored for this single-node run", flag)
    one = argparse.Namespace(**{**vars(args), "master_addr": args.master_addr or "127.0.0.1", "node_rank": 0})
    return node.job_from_args(one, {host: slots}, cuda_devices)


def plan_launch(args: argparse.Namespace, environ: Mapping[str, str], hostfile: dict[str, int] | None,
                cuda_devices: list[str] | None, available_cores: Sequence[int], names: set[str]) -> AgentJob:
    """A single-machine launch as torch's agent will run it (pure: nothing is started or read from the system
    here). A selection of several nodes raises (see :func:`launch_mode`)."""
    return node.node_agent_job(local_job(args, hostfile, cuda_devices, names), environ, available_cores, environ)


def _with_port(args: argparse.Namespace, mode: str, flag: str = "--master_port") -> argparse.Namespace:
    """``--master_port 0`` (``flag``: how the command the user typed spells it): a free port of this machine,
    logged (one machine only: every node of a multi-node job must be told the same port)."""
    if args.master_port != 0:
        return args
    if mode != "local":
        raise LaunchError(f"{flag} 0 (a free port) works on one machine only: every node must know the "
                          "port, so pass the same free port number to the whole job")
    port = free_port(args.master_addr or "127.0.0.1")
    logger.info("%s 0: rendezvous on free port %d", flag, port)
    return argparse.Namespace(**{**vars(args), "master_port": port})


def _prepare(args: argparse.Namespace, port_flag: str = "--master_port") -> Runner:
    """Check and plan everything before a process starts; returns the launch's runner. Errors about the port
    name ``port_flag``, the flag of the command the user typed."""
    hostfile = read_hostfile(args.hostfile)
    if hostfile is None and args.hostfile != DEFAULT_HOSTFILE:
        logger.warning("hostfile %s not found; launching on this machine only", args.hostfile)
    cuda_devices, names = detect_cuda_devices(os.environ), local_hostnames()
    active = select_nodes(args, hostfile, cuda_devices, names)  # a contradictory selection first, as DeepSpeed
    if not (args.module or args.no_python) and not os.path.isfile(args.user_script):
        raise LaunchError(f"user script {args.user_script!r} does not exist (cwd {os.getcwd()}); "
                          "fix the path, or pass --module to run a module")
    if hostfile is None and cuda_devices is None and args.num_gpus <= 0 and not args.include:
        logger.info("CPU only: starting 1 process; --num_gpus N starts N processes")
    if args.no_ssh:
        args = node.with_node_rank(args, os.environ)  # `srun deepshard --no_ssh ...`: one per node
    mode = launch_mode(args, active, shutil.which("pdsh") is not None)
    args = _with_port(route_ranks(args, real_deepspeed(), os.environ), mode, port_flag)
    master_addr, cores = args.master_addr or next(iter(active)), sorted(os.sched_getaffinity(0))
    if mode == "local":
        job, env = local_job(args, hostfile, cuda_devices, names), os.environ
    elif mode == "no_ssh":
        job = node.job_from_args(argparse.Namespace(**{**vars(args), "master_addr": master_addr}), active,
                                 cuda_devices)
        env = {**os.environ, **read_env_files(env_file_paths(os.environ, os.path.expanduser("~"), os.getcwd()))}
    else:
        return _prepare_remote(args, mode, active, master_addr)
    node.node_agent_job(job, env, cores)  # errors surface now
    if mode == "local":
        check_port_free(args.master_addr or "127.0.0.1", args.master_port, port_flag)
        if args.enable_each_rank_log:
            prepare_log_dir(args.enable_each_rank_log)
    return lambda started: node.run_node(job, env, cores, started)


def _prepare_remote(args: argparse.Namespace, mode: str, active: dict[str, list[int]], master_addr: str) -> Runner:
    if mode in ("ssh", "pdsh") and not args.no_ssh_check:
        multinode.check_ssh(list(active), args.ssh_port, shlex.split(args.launcher_args))
    specs = multinode.plan_runners(args, mode, active, master_addr, job_exports(os.environ), os.environ, os.getcwd())
    logger.info("starting %d nodes with %s: %s (master %s:%d)", len(active), mode,
                ", ".join(f"{h}[{len(s)}]" for h, s in active.items()), master_addr, args.master_port)
    return lambda started: multinode.run_agents(specs, started)


def main(argv: list[str] | None = None, port_flag: str = "--master_port", raise_errors: bool = False) -> int:
    """Entry point of the ``deepshard`` console script: a subcommand, else DeepSpeed's launcher; no arguments
    prints the help to stderr and returns 2. ``port_flag``: how errors name the port (``deepshard launch``
    passes its own ``--main_process_port``). A command line that cannot be launched prints why and returns 2,
    or, with ``raise_errors`` (DeepSpeed's ``runner.main`` API), raises the ``ValueError``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        parser = build_parser()
        add_command_list(parser)
        parser.print_help(sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    found = find_command(argv)
    if found is not None:
        return run_command(found[0], argv[1:])
    return launch(parse_args(argv), argv, port_flag, raise_errors)


def _error(exc: Exception) -> int:
    print(f"deepshard: error: {exc}", file=sys.stderr, flush=True)
    return 2


def launch(args: argparse.Namespace, argv: list[str], port_flag: str = "--master_port",
           raise_errors: bool = False) -> int:
    """Run the launch a parsed command line describes (``argv``: the words it was parsed from, which
    autotuning trials reuse); returns the exit status (``raise_errors``: see :func:`main`)."""
    if args.quiet or args.log_level:
        logger.setLevel(logging.WARNING if args.quiet else args.log_level.upper())
    if args.verbose:
        os.environ[report.VERBOSE_ENV] = "1"
    if sys.stderr.isatty():  # the ranks' output reaches a terminal through the launcher: rank 0 shows bars
        os.environ.setdefault(PROGRESS_ENV, "1")
    try:
        if args.autotuning:  # trials through this launcher, then (run) the training: deepshard.autotuning
            from deepshard.autotuning.tuner import main as autotune

            return autotune(args, argv, main)
        run = _prepare(args, port_flag)
    except (LaunchError, ValueError) as exc:
        if raise_errors:
            raise
        return _error(exc)
    pid_file = os.path.join(PID_FILE_DIR, f"{os.getpid()}.deepshard") if args.save_pid else None
    try:
        with report.error_dir(os.environ):
            return run(None if pid_file is None else lambda pids: _write_pid_file(pid_file, pids))
    except (LaunchError, ValueError) as exc:
        if raise_errors:
            raise
        return _error(exc)
    finally:
        if pid_file and os.path.exists(pid_file):
            os.remove(pid_file)


def _write_pid_file(path: str, pids: list[int]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(str(pid) for pid in [os.getpid(), *pids]) + "\n")


if __name__ == "__main__":
    sys.exit(main())
