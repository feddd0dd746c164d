"""A node's part of a job: its ranks under torch's elastic agent, in step with the other nodes."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence

from deepshard.launcher.hostfile import decode_world_info
from deepshard.launcher.local import NodeJob, detect_cuda_devices, node_agent_job, parse_core_list
from deepshard.launcher.options import LaunchError, add_elastic_args, add_process_args, add_script_args, env_seconds
from deepshard.utils.logging import logger

JOIN_TIMEOUT_S = 300.0


def run_node(job: NodeJob, base_env: Mapping[str, str], available_cores: Sequence[int],
             on_started: Callable[[list[int]], None] | None = None) -> int:
    """Run this node's part of the job on torch's agent, meeting the other nodes through torch's c10d rendezvous
    on ``master_addr:master_port``; returns the exit status."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # the agent's store errors are reported by us
    from deepshard.launcher.agent import run_agent
    from deepshard.launcher.board import HEARTBEAT_TIMEOUT_S
    from deepshard.launcher.rendezvous import RendezvousFailed, open_rendezvous

    ajob = node_agent_job(job, base_env, available_cores)
    timeout, nodes = env_seconds(base_env, "DEEPSHARD_JOIN_TIMEOUT", JOIN_TIMEOUT_S), len(job.hosts)
    if job.elastic is not None:
        logger.info("node %s: elastic rendezvous (c10d) at %s for %d..%d nodes", job.host, job.endpoint, *job.elastic)
    elif nodes > 1:
        logger.info("node %d (%s): %s the rendezvous (c10d) at %s", job.node_rank, job.host,
                    "serving" if job.node_rank == 0 else "joining", job.endpoint)
    try:
        rdzv = open_rendezvous(job, timeout, None if job.elastic else job.node_rank == 0)
    except RendezvousFailed as exc:
        where = f"node {job.node_rank} ({job.host}): " if nodes > 1 else ""
        print(f"deepshard: {where}{exc}", file=sys.stderr, flush=True)
        return 1
    if rdzv.board is not None:
        rdzv.board.heartbeat_timeout_s = env_seconds(base_env, "DEEPSHARD_HEARTBEAT_TIMEOUT", HEARTBEAT_TIMEOUT_S)
        rdzv.board.start_heartbeat()
    return run_agent(ajob, rdzv, on_started)


# Where an agent started by ``mpirun`` / ``srun`` (one task per node) finds its node rank.
NODE_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")


def with_node_rank(args: argparse.Namespace, environ: Mapping[str, str]) -> argparse.Namespace:
    """``args`` with ``--node_rank`` filled in, when it was not given, from the first of
    :data:`NODE_RANK_VARIABLES` that an MPI or Slurm runner set to a number."""
    found = next((name for name in NODE_RANK_VARIABLES if environ.get(name, "").isdigit()), None)
    if args.node_rank >= 0 or found is None:
        return args
    logger.info("node rank %s from %s (started by an MPI / Slurm runner)", environ[found], found)
    return argparse.Namespace(**{**vars(args), "node_rank": int(environ[found])})


def elastic_range(args: argparse.Namespace, num_nodes: int) -> tuple[int, int] | None:
    """``(min, max)`` nodes of ``--elastic_training`` (defaults 1 and the selected hosts), else None."""
    if not getattr(args, "elastic_training", False):
        return None
    low = 1 if args.min_elastic_nodes == -1 else args.min_elastic_nodes
    high = num_nodes if args.max_elastic_nodes == -1 else args.max_elastic_nodes
    if not 1 <= low <= high:
        raise LaunchError(f"--min_elastic_nodes {low} / --max_elastic_nodes {high}: need 1 <= min <= max")
    return low, high


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m deepshard.launcher.node", allow_abbrev=False,
                                     description="deepshard's per-node agent (started by the launcher)")
    parser.add_argument("--world_info", required=True, help="the selected hosts and slots (base64 JSON)")
    parser.add_argument("--node_rank", type=int, default=-1,
                        help="this node's index in the world (default: from OMPI_COMM_WORLD_RANK, PMI_RANK, "
                             "PMIX_RANK, MV2_COMM_WORLD_RANK or SLURM_PROCID)")
    parser.add_argument("--master_addr", required=True, help="node 0's address")
    parser.add_argument("--master_port", type=int, required=True, help="port of node 0's store (agents and ranks)")
    parser.add_argument("--max_restarts", type=int, default=0, help="restarts after a failure")
    parser.add_argument("--exit_on_stdin_close", action="store_true",
                        help="stop the job when stdin reaches end-of-file (the ssh launcher went away)")
    parser.add_argument("--report_on_node0", action="store_true",
                        help="only node 0 prints failure reports (all nodes share one terminal)")
    add_elastic_args(parser)
    add_process_args(parser)
    add_script_args(parser)
    return parser


def job_from_args(args: argparse.Namespace, world: dict[str, list[int]], devices: list[str] | None) -> NodeJob:
    """A :class:`NodeJob` from the launcher's / agent's parsed flags (``devices``: the visible CUDA devices)."""
    core_list = parse_core_list(args.bind_core_list) if args.bind_core_list else None
    return NodeJob(world, args.node_rank, args.user_script, list(args.user_args), args.master_addr, args.master_port,
                   args.module, args.no_python, args.no_local_rank,
                   devices,
                   args.bind_cores_to_rank or core_list is not None, core_list, args.max_restarts,
                   args.enable_each_rank_log, getattr(args, "exit_on_stdin_close", False),
                   getattr(args, "report_on_node0", False), elastic_range(args, len(world)))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quiet or args.log_level:
        logger.setLevel(logging.WARNING if args.quiet else args.log_level.upper())
    base_env = dict(os.environ)
    args = with_node_rank(args, base_env)
    try:
        if args.node_rank < 0:
            raise LaunchError("no --node_rank, and none of " + ", ".join(NODE_RANK_VARIABLES) + " is set; pass "
                              "--node_rank N, or start one agent per node with mpirun / srun")
        job = job_from_args(args, decode_world_info(args.world_info), detect_cuda_devices(base_env))
        return run_node(job, base_env, sorted(os.sched_getaffinity(0)))
    except (LaunchError, ValueError) as exc:
        print(f"deepshard node agent: error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
