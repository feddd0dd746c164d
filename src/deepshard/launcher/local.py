"""One machine's part of a launch: what each local rank runs (command, environment, CPU cores), as pure functions
(a bad selection raises :class:`LaunchError` before anything starts)."""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from deepshard.launcher.options import LaunchError

TORCH_SETS = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "CROSS_RANK", "CROSS_SIZE", "DEEPSHARD_RESTART_COUNT"})
"""Variables torch's agent (or the rank shim) sets itself, per rank and attempt: never copied into a job."""
LOCAL_RANK_MACRO = "${local_rank}"  # torch's agent puts each rank's local rank there


def detect_cuda_devices(environ: Mapping[str, str]) -> list[str] | None:
    """The visible CUDA device ids in slot order, or ``None`` on CPU (torch is imported only with a GPU driver)."""
    forced = environ.get("DEEPSHARD_ACCELERATOR") or environ.get("DS_ACCELERATOR")
    if forced == "cpu" or (forced != "cuda" and not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd"))):
        return None
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        if forced == "cuda":
            raise LaunchError("DEEPSHARD_ACCELERATOR=cuda but torch sees no CUDA device; unset it to run on CPU")
        return None
    count = torch.cuda.device_count()
    ids = [item.strip() for item in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if item.strip()]
    return ids[:count] if ids else [str(i) for i in range(count)]


def build_rank_command(user_script: str, user_args: Sequence[str], local_rank: int | str, *,
                       module: bool = False, no_python: bool = False, no_local_rank: bool = False,
                       python: str = sys.executable) -> list[str]:
    """One rank's argv, ``python -u script --local_rank=N args`` (``-m``, bare with ``no_python``), with
    ``--local_rank`` right after the script, where DeepSpeed puts it."""
    cmd = [user_script] if no_python else [python, "-u", *(["-m"] if module else []), user_script]
    return [*cmd, *([] if no_local_rank else [f"--local_rank={local_rank}"]), *user_args]


def parse_core_list(text: str) -> list[int]:
    """Parse ``--bind_core_list`` such as ``"0,3-5"`` into ``[0, 3, 4, 5]`` (order kept, no repeats)."""
    cores: list[int] = []
    for item in (item.strip() for item in text.split(",")):
        low, sep, high = item.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise LaunchError(f"--bind_core_list {text!r}: {item!r} is not a core number or range; expected e.g. "
                              "'0,2-5'")
        first, last = int(low), int(high) if sep else int(low)
        if last < first:
            raise LaunchError(f"--bind_core_list {text!r}: range {item!r} runs backwards; write '{last}-{first}'")
        cores.extend(core for core in range(first, last + 1) if core not in cores)
    return cores


def split_cores(cores: Sequence[int], nprocs: int) -> list[tuple[int, ...]]:
    """Give each of ``nprocs`` ranks an equal, disjoint block of ``cores`` (the remainder is unused)."""
    per_rank = len(cores) // nprocs
    if per_rank < 1:
        raise LaunchError(f"cannot bind {nprocs} ranks to {len(cores)} cores ({list(cores)}): each rank "
                          "needs at least one core; launch fewer ranks or drop --bind_cores_to_rank")
    return [tuple(cores[i * per_rank:(i + 1) * per_rank]) for i in range(nprocs)]


def omp_threads(base_env: Mapping[str, str], num_cores: int, nprocs: int,
                bound_cores: int | None) -> int | None:
    """``OMP_NUM_THREADS`` for each rank: the bound core count when binding; otherwise
    ``max(1, cores // nprocs)`` unless the user already set it (then ``None``: keep theirs)."""
    if bound_cores is not None:
        return bound_cores
    return None if "OMP_NUM_THREADS" in base_env else max(1, num_cores // max(nprocs, 1))


@dataclass(frozen=True)
class NodeJob:
    """What one node's agent runs: the whole world (hosts and slots, in rank order), which node this is, and how
    each rank runs. ``visible_devices``: CUDA device ids by slot (slot i -> ``visible_devices[i]``), ``None`` on
    CPU; ``core_list``: the cores to share among the ranks when binding (``None``: every core this process may
    use). ``report_on_node0``: started by ssh / pdsh, every node's output reaches one terminal, so only node 0
    prints the failure report (otherwise the failing node prints its own too). ``elastic``:
    ``--elastic_training``'s fewest and most nodes of torch's c10d rendezvous (None: static node ranks)."""

    world: dict[str, list[int]]
    node_rank: int
    user_script: str
    user_args: list[str]
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    visible_devices: list[str] | None = None
    bind_cores: bool = False
    core_list: list[int] | None = None
    max_restarts: int = 0
    log_dir: str | None = None
    exit_on_stdin_close: bool = False
    report_on_node0: bool = False
    elastic: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.node_rank < len(self.world):
            raise LaunchError(f"--node_rank {self.node_rank} is out of range: the selection has "
                              f"{len(self.world)} nodes ({', '.join(self.world)}), so node ranks run "
                              f"0..{len(self.world) - 1}")

    @property
    def hosts(self) -> list[str]:
        return list(self.world)

    @property
    def host(self) -> str:
        return self.hosts[self.node_rank]

    @property
    def endpoint(self) -> str:
        """Where node 0's agent serves torch's c10d rendezvous store."""
        return f"{self.master_addr}:{self.master_port}"

    @property
    def node_range(self) -> tuple[int, int]:
        """The fewest and most nodes of the rendezvous: ``elastic``'s, else every node of the world."""
        return self.elastic or (len(self.world), len(self.world))

    def fingerprint(self) -> str:
        """What every node must agree on (compared through the rendezvous store)."""
        return json.dumps({"world": self.world, "max_restarts": self.max_restarts, "master_port": self.master_port},
                          sort_keys=True)


@dataclass(frozen=True)
class AgentJob:
    """What one node's agent runs: one rank's command (:data:`LOCAL_RANK_MACRO` stands for its local rank), how many
    ranks, the variables set for every rank (``CUDA_VISIBLE_DEVICES``, ``OMP_NUM_THREADS``, env-file variables),
    each local rank's CPU cores (``--bind_cores_to_rank``), and the variables the user set themselves (an
    ``OMP_NUM_THREADS`` of theirs wins over core binding)."""

    argv: list[str]
    nproc: int
    rank_env: dict[str, str] = field(default_factory=dict)
    cores: list[tuple[int, ...]] | None = None
    max_restarts: int = 0
    log_dir: str | None = None
    user_env: frozenset[str] = frozenset()


def node_agent_job(job: NodeJob, base_env: Mapping[str, str], available_cores: Sequence[int],
                   launcher_env: Mapping[str, str] = os.environ, python: str = sys.executable) -> AgentJob:
    """What torch's agent runs for this node's slots (pure: the plan's errors surface before anything starts): one
    command with torch's local-rank macro, the variables torch does not set (those of ``base_env`` the launcher
    lacks, devices, threads), each rank's cores."""
    slots = job.world[job.host]
    env = {k: v for k, v in base_env.items() if k not in TORCH_SETS and launcher_env.get(k) != v}
    env["PYTHONUNBUFFERED"] = "1"
    devices = job.visible_devices
    if devices is not None:
        if any(s >= len(devices) for s in slots):
            raise LaunchError(f"slots {[s for s in slots if s >= len(devices)]} are selected but only {len(devices)} "
                              f"CUDA devices are visible ({','.join(devices)}); select slots below {len(devices)}")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[s] for s in slots)
    cores = None
    if job.bind_cores:
        pool = list(job.core_list) if job.core_list is not None else list(available_cores)
        outside = [c for c in pool if c not in available_cores]
        if outside:
            raise LaunchError(f"--bind_core_list names cores {outside} this process may not run on; "
                              f"usable cores: {sorted(available_cores)}")
        cores = split_cores(pool, len(slots))
    threads = omp_threads(base_env, len(available_cores), len(slots), len(cores[0]) if cores else None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    argv = build_rank_command(job.user_script, job.user_args, LOCAL_RANK_MACRO, module=job.module,
                              no_python=job.no_python, no_local_rank=job.no_local_rank, python=python)
    return AgentJob(argv, len(slots), env, cores, job.max_restarts, job.log_dir,
                    frozenset({"OMP_NUM_THREADS"} & set(base_env)))
