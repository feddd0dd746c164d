"""The ``deepshard`` command: DeepSpeed's launcher flags, single-machine launch.

``deepshard --num_gpus 2 train.py --deepspeed --deepspeed_config ds_config.json`` starts two ranks of
``train.py`` on this machine (``--local_rank=N`` appended to each, the ``env://`` variables set) and
supervises them (see :mod:`deepshard.launcher.supervisor`).

Slots: on CUDA a slot is a visible GPU (``torch.cuda.device_count()``); on a CPU machine a slot is a
process, so ``--num_gpus N`` (alias ``--num_accelerators``) starts N processes and the default is one.

A hostfile (``-H``, default ``/job/hostfile``; none means "this machine only") is parsed and
``--include`` / ``--exclude`` / ``--num_nodes`` / ``--num_gpus`` select from it as in DeepSpeed. A
launch that would span more than one node stops with an error: multi-node runners (pdsh/ssh,
``--no_ssh``, MPI, Slurm) are not implemented yet; their flags are accepted and ignored locally.

Exit status: 0 when every rank succeeds; the failing rank's exit code (1 when it died by a signal);
128+N when the launcher got signal N (forwarded to the ranks); 2 for a bad command line or selection.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Mapping, Sequence

from deepshard.launcher.hostfile import assign_ranks, parse_node_spec, read_hostfile, resolve_resources
from deepshard.launcher.local import LocalLaunch, RankSpec, parse_core_list, plan_local_ranks, run_local
from deepshard.utils.logging import logger

DEFAULT_HOSTFILE = "/job/hostfile"
DEFAULT_MASTER_PORT = 29500
LOCAL_HOST = "localhost"
PID_FILE_DIR = "/tmp"

_MULTI_NODE_ONLY = ("launcher", "launcher_args", "no_ssh", "no_ssh_check", "ssh_port", "venv_script")


class LaunchError(ValueError):
    """A command line or resource selection that cannot be launched; the message says why and how to fix."""


def _add_resource_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-H", "--hostfile", default=DEFAULT_HOSTFILE,
                        help="hostfile of '<host> slots=<n>' lines; missing means this machine only")
    parser.add_argument("-i", "--include", default="", help="NODE_SPEC[@NODE_SPEC...], e.g. 'worker-0@worker-1:0,2'")
    parser.add_argument("-e", "--exclude", default="", help="NODE_SPEC[@NODE_SPEC...] to leave out")
    parser.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile")
    parser.add_argument("--num_gpus", "--num_accelerators", dest="num_gpus", type=int, default=-1,
                        help="slots [0, N) per node; on a CPU machine, the number of processes")
    parser.add_argument("--master_port", type=int, default=DEFAULT_MASTER_PORT, help="rendezvous port")
    parser.add_argument("--master_addr", default="", help="rendezvous address (local runs: 127.0.0.1)")
    parser.add_argument("--node_rank", type=int, default=-1, help="this node's index (multi-node --no_ssh)")


def _add_multi_node_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--launcher", default="pdsh",
                        help="multi-node runner: pdsh, openmpi, mvapich, mpich, impi, slurm (not yet)")
    parser.add_argument("--launcher_args", default="", help="extra arguments for the multi-node runner")
    parser.add_argument("--no_ssh", action="store_true", help="multi-node without ssh (run on each node)")
    parser.add_argument("--no_ssh_check", action="store_true", help="skip the ssh reachability check")
    parser.add_argument("--force_multi", action="store_true", help="use the multi-node path even for one node")
    parser.add_argument("--ssh_port", type=int, default=None, help="ssh port for multi-node runners")
    parser.add_argument("--venv_script", default=None, help="script sourced on each node before launch")
    parser.add_argument("--autotuning", default="", choices=["", "tune", "run"], help="not supported")
    parser.add_argument("--elastic_training", action="store_true", help="not supported")
    parser.add_argument("--min_elastic_nodes", type=int, default=-1, help="not supported")
    parser.add_argument("--max_elastic_nodes", type=int, default=-1, help="not supported")


def _add_process_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--module", action="store_true", help="run user_script as 'python -m <module>'")
    parser.add_argument("--no_python", action="store_true", help="run user_script directly, not via python")
    parser.add_argument("--no_local_rank", action="store_true", help="do not append --local_rank=N")
    parser.add_argument("--save_pid", action="store_true",
                        help=f"write {PID_FILE_DIR}/<launcher pid>.deepshard: the launcher pid, then the "
                             "rank pids, one per line; removed when the launcher exits")
    parser.add_argument("--enable_each_rank_log", default=None, metavar="DIR",
                        help="also write each rank's output to DIR/rank_<N>.log")
    parser.add_argument("--bind_cores_to_rank", action="store_true",
                        help="pin each rank to an equal share of the CPU cores; OMP_NUM_THREADS = share")
    parser.add_argument("--bind_core_list", default=None, help="cores to share out, e.g. '0,2-5'")
    parser.add_argument("--log_level", default=None, choices=["debug", "info", "warning", "error", "critical"],
                        help="launcher log level (default: DEEPSHARD_LOG_LEVEL, else info)")
    parser.add_argument("-q", "--quiet", action="store_true", help="launcher logs warnings and errors only")


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argument parser (DeepSpeed's flags; the user's script and its arguments last)."""
    parser = argparse.ArgumentParser(
        prog="deepshard", description="Launch a training script on this machine, one process per slot.")
    _add_resource_args(parser)
    _add_multi_node_args(parser)
    _add_process_args(parser)
    parser.add_argument("user_script", help="the training script (a module name with --module)")
    parser.add_argument("user_args", nargs=argparse.REMAINDER, help="arguments passed on to the script")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the launcher's command line; everything after the script belongs to the script."""
    return build_parser().parse_args(argv)


def local_hostnames() -> set[str]:
    """Names under which a hostfile may list this machine (no DNS lookups)."""
    name = socket.gethostname()
    return {LOCAL_HOST, "127.0.0.1", name, name.split(".")[0]}


def detect_cuda_devices(environ: Mapping[str, str]) -> list[str] | None:
    """The CUDA device ids visible to this launcher, in slot order, or ``None`` on a CPU machine.

    torch is imported only when a GPU driver is present (or ``DEEPSHARD_ACCELERATOR=cuda``), so the
    launcher starts fast on CPU machines.
    """
    forced = environ.get("DEEPSHARD_ACCELERATOR") or environ.get("DS_ACCELERATOR")
    if forced == "cpu":
        return None
    if forced != "cuda" and not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd")):
        return None
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        if forced == "cuda":
            raise LaunchError("DEEPSHARD_ACCELERATOR=cuda but torch sees no CUDA device; "
                              "unset it to run on CPU")
        return None
    count = torch.cuda.device_count()
    visible = environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [item.strip() for item in visible.split(",") if item.strip()]
    return ids[:count] if ids else [str(i) for i in range(count)]


def _localize_spec(spec: str, names: set[str]) -> str:
    """Rewrite this machine's aliases in a node spec to ``localhost`` (runs without a hostfile)."""
    if not spec:
        return spec
    parts = []
    for host, slots in parse_node_spec(spec).items():
        host = LOCAL_HOST if host in names else host
        parts.append(host if slots is None else f"{host}:{','.join(map(str, slots))}")
    return "@".join(parts)


def _cpu_slot_count(args: argparse.Namespace, include: str) -> int:
    """Slots of this machine without a hostfile on CPU, where a slot is a process."""
    if args.num_gpus > 0:
        return args.num_gpus
    wanted = parse_node_spec(include).get(LOCAL_HOST) if include else None
    if wanted:
        return max(wanted) + 1
    if not include:
        logger.info("CPU only: starting 1 process; --num_gpus N starts N processes")
    return 1


def _resources(args: argparse.Namespace, hostfile: dict[str, int] | None,
               cuda_devices: list[str] | None, names: set[str]) -> tuple[dict[str, int], str, str]:
    """Hosts and slot counts to select from, and the include/exclude specs to apply."""
    if hostfile is not None:
        return dict(hostfile), args.include, args.exclude
    if args.num_nodes > 1:
        raise LaunchError(f"--num_nodes {args.num_nodes} needs a hostfile listing the nodes, but "
                          f"{args.hostfile} does not exist; pass -H/--hostfile or drop --num_nodes")
    include, exclude = _localize_spec(args.include, names), _localize_spec(args.exclude, names)
    if cuda_devices is not None:
        return {LOCAL_HOST: len(cuda_devices)}, include, exclude
    return {LOCAL_HOST: _cpu_slot_count(args, include)}, include, exclude


def _single_node(active: dict[str, list[int]], args: argparse.Namespace, names: set[str]) -> str:
    hosts = list(active)
    if len(hosts) > 1 or args.force_multi:
        raise LaunchError(
            f"this launch would use {len(hosts)} node(s) ({', '.join(hosts)}"
            f"{', --force_multi' if args.force_multi else ''}), but multi-node launch (pdsh/ssh, "
            "--no_ssh with --node_rank, OpenMPI/MPICH/MVAPICH/Intel MPI, Slurm) is not implemented yet "
            "in deepshard; select one node (--num_nodes 1 or --include HOST), or start each node's "
            "processes yourself (e.g. torchrun) and call deepshard.init_distributed()")
    host = hosts[0]
    if host not in names:
        logger.warning("the selection names only host %r, which is not this machine (%s); "
                       "running its %d slots here, as DeepSpeed does for a single node",
                       host, socket.gethostname(), len(active[host]))
    return host


def _check_supported(args: argparse.Namespace) -> None:
    if args.autotuning:
        raise LaunchError(f"--autotuning {args.autotuning} is not supported by deepshard; drop it")
    if args.elastic_training:
        raise LaunchError("--elastic_training is not supported by deepshard; drop it")
    if args.module and args.no_python:
        raise LaunchError("--module and --no_python cannot be combined; pick one")


def plan_launch(args: argparse.Namespace, environ: Mapping[str, str], hostfile: dict[str, int] | None,
                cuda_devices: list[str] | None, available_cores: Sequence[int],
                names: set[str]) -> list[RankSpec]:
    """Turn parsed flags and the machine's facts into one :class:`RankSpec` per local rank (pure:
    nothing is started or read from the system here)."""
    _check_supported(args)
    resources, include, exclude = _resources(args, hostfile, cuda_devices, names)
    try:
        active = resolve_resources(resources, include, exclude, args.num_nodes, args.num_gpus)
    except ValueError as exc:
        raise LaunchError(str(exc)) from exc
    host = _single_node(active, args, names)
    for flag in _MULTI_NODE_ONLY:
        if getattr(args, flag) not in (None, "", False, "pdsh"):
            logger.info("--%s only matters for multi-node launch; ignored for this single-node run", flag)
    core_list = parse_core_list(args.bind_core_list) if args.bind_core_list else None
    launch = LocalLaunch(
        user_script=args.user_script, user_args=list(args.user_args),
        master_addr=args.master_addr or "127.0.0.1", master_port=args.master_port,
        module=args.module, no_python=args.no_python, no_local_rank=args.no_local_rank,
        visible_devices=cuda_devices, bind_cores=args.bind_cores_to_rank or core_list is not None,
        core_list=core_list)
    slots = [slot for _, _, slot, _ in assign_ranks({host: active[host]})]
    try:
        return plan_local_ranks(launch, slots, environ, available_cores)
    except ValueError as exc:
        raise LaunchError(str(exc)) from exc


def _write_pid_file(path: str, pids: list[int]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(str(pid) for pid in [os.getpid(), *pids]) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``deepshard`` console script; returns the exit status."""
    args = parse_args(argv)
    if args.quiet or args.log_level:
        logger.setLevel(logging.WARNING if args.quiet else args.log_level.upper())
    try:
        if not (args.module or args.no_python) and not os.path.isfile(args.user_script):
            raise LaunchError(f"user script {args.user_script!r} does not exist (cwd {os.getcwd()}); "
                              "fix the path, or pass --module to run a module")
        hostfile = read_hostfile(args.hostfile)
        if hostfile is None and args.hostfile != DEFAULT_HOSTFILE:
            logger.warning("hostfile %s not found; launching on this machine only", args.hostfile)
        cuda_devices = detect_cuda_devices(os.environ)
        specs = plan_launch(args, os.environ, hostfile, cuda_devices,
                            sorted(os.sched_getaffinity(0)), local_hostnames())
    except (LaunchError, ValueError) as exc:
        print(f"deepshard: error: {exc}", file=sys.stderr, flush=True)
        return 2
    pid_file = os.path.join(PID_FILE_DIR, f"{os.getpid()}.deepshard") if args.save_pid else None
    on_started = (lambda pids: _write_pid_file(pid_file, pids)) if pid_file else None
    try:
        return run_local(specs, log_dir=args.enable_each_rank_log, on_started=on_started)
    finally:
        if pid_file and os.path.exists(pid_file):
            os.remove(pid_file)


if __name__ == "__main__":
    sys.exit(main())
