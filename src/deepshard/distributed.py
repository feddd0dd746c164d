"""``init_distributed``: start ``torch.distributed`` from whatever launched this process.

Where the rank, world size, local rank and rendezvous address come from, first match wins:

1. explicit ``rank`` / ``world_size`` arguments;
2. the deepshard launcher's or torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
   ``MASTER_ADDR``, ``MASTER_PORT``);
3. with ``auto_mpi_discovery``: OpenMPI (``OMPI_COMM_WORLD_*``), MVAPICH (``MV2_COMM_WORLD_*``),
   MPICH / Intel MPI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``), Slurm (``SLURM_PROCID``,
   ``SLURM_NTASKS``, ``SLURM_LOCALID``);
4. nothing at all (a plain ``python train.py``): a world of one process on an in-memory store, so no
   port is opened.

The resolution is the pure function :func:`resolve_dist_env`, testable without a process group.

gloo and the network interface: gloo binds to the address this machine's hostname resolves to, and
falls back to the loopback address when that is not a local address (containers, network
namespaces), which breaks any job that spans machines. In exactly that case, when
``GLOO_SOCKET_IFNAME`` is unset and the world spans machines, :func:`init_distributed` sets it to
the interface of the route to ``MASTER_ADDR`` (:func:`gloo_interface_for`), and says so.
Slurm's rendezvous host: ``MASTER_ADDR`` if set, else the first host of the step's / job's node list
(where task 0 runs with Slurm's default block distribution), else ``SLURM_LAUNCH_NODE_IPADDR``. The
node list is preferred over the launch node because ``srun`` started from a login node (inside
``salloc``) would otherwise point every rank at the login node, where no rank listens.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from deepshard.utils.logging import log_rank0, logger
from deepshard.utils.teardown import destroy_process_group_at_exit

DEFAULT_TIMEOUT_MINUTES = 10.0
LOCAL_MASTER = "127.0.0.1"


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job. ``source`` is one of ``args``, ``env``, ``openmpi``,
    ``mvapich``, ``mpich``, ``slurm`` or ``none`` (no launcher: a world of one)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int
    source: str


@dataclass(frozen=True)
class _Found:
    rank: int
    world_size: int
    local_rank: int | None
    local_size: int | None
    master_addr: str | None
    source: str
    single_node: bool | None = None


def _int(environ: Mapping[str, str], key: str) -> int | None:
    value = environ.get(key)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {key}={value!r} is not an integer; fix or unset it") from None


def _first_host(nodelist: str) -> str | None:
    """First host of a Slurm node list (``node[03-05,9],gpu1`` -> ``node03``); ``None`` if not simple."""
    match = re.match(r"^([^\[\],]+)(?:\[([^\]]+)\]([^\[\],]*))?(?:,|$)", nodelist.strip())
    if match is None:
        return None
    prefix, ranges, suffix = match.group(1), match.group(2), match.group(3) or ""
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}{suffix}" if first.isdigit() else None


def _from_launcher(environ: Mapping[str, str]) -> _Found | None:
    rank, size = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
    if rank is None or size is None:
        return None
    return _Found(rank, size, _int(environ, "LOCAL_RANK"), _int(environ, "LOCAL_WORLD_SIZE"),
                  environ.get("MASTER_ADDR") or None, "env")


def _from_mpi(environ: Mapping[str, str], prefix: str, source: str) -> _Found | None:
    rank, size = _int(environ, f"{prefix}_RANK"), _int(environ, f"{prefix}_SIZE")
    if rank is None or size is None:
        return None
    return _Found(rank, size, _int(environ, f"{prefix}_LOCAL_RANK"), _int(environ, f"{prefix}_LOCAL_SIZE"),
                  None, source)


def _from_mpich(environ: Mapping[str, str]) -> _Found | None:
    rank, size = _int(environ, "PMI_RANK"), _int(environ, "PMI_SIZE")
    if rank is None or size is None:
        return None
    return _Found(rank, size, _int(environ, "MPI_LOCALRANKID"), _int(environ, "MPI_LOCALNRANKS"),
                  None, "mpich")


def _from_slurm(environ: Mapping[str, str]) -> _Found | None:
    rank, size = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_NTASKS")
    if rank is None or size is None:
        return None
    nodes = _int(environ, "SLURM_STEP_NUM_NODES") or _int(environ, "SLURM_JOB_NUM_NODES") \
        or _int(environ, "SLURM_NNODES")
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") \
        or environ.get("SLURM_NODELIST") or ""
    master = _first_host(nodelist) if nodelist else None
    master = master or environ.get("SLURM_LAUNCH_NODE_IPADDR") or None
    return _Found(rank, size, _int(environ, "SLURM_LOCALID"), None, master, "slurm",
                  single_node=None if nodes is None else nodes == 1)


def _discover(environ: Mapping[str, str], auto_mpi_discovery: bool) -> _Found | None:
    found = _from_launcher(environ)
    if found is not None or not auto_mpi_discovery:
        return found
    for probe in (lambda e: _from_mpi(e, "OMPI_COMM_WORLD", "openmpi"),
                  lambda e: _from_mpi(e, "MV2_COMM_WORLD", "mvapich"), _from_mpich, _from_slurm):
        found = probe(environ)
        if found is not None:
            return found
    return None


def _fits_one_machine(found: _Found | None, world_size: int) -> bool:
    if world_size == 1:
        return True
    if found is None:
        return True  # explicit rank/world_size with no launcher: processes spawned on this machine
    if found.single_node is not None:
        return found.single_node
    if found.local_size is not None:
        return found.local_size >= world_size
    return found.source in ("args", "env")


def _master_addr(environ: Mapping[str, str], found: _Found | None, world_size: int,
                 init_method: str | None) -> str | None:
    addr = environ.get("MASTER_ADDR") or (found.master_addr if found else None)
    if addr or init_method is not None:
        return addr
    if _fits_one_machine(found, world_size):
        return LOCAL_MASTER
    source = found.source if found else "args"
    raise ValueError(
        f"cannot tell where rank 0 listens: world size {world_size} (from {source}) spans several "
        "machines and MASTER_ADDR is not set; export MASTER_ADDR=<host of rank 0> (and MASTER_PORT), "
        "or pass init_method='tcp://HOST:PORT'")


def resolve_dist_env(environ: Mapping[str, str], rank: int = -1, world_size: int = -1,
                     distributed_port: int = 29500, auto_mpi_discovery: bool = True,
                     init_method: str | None = None) -> DistEnv:
    """Work out this process's rank, world size, local rank and rendezvous address from explicit
    arguments, then ``environ`` (launcher/torchrun, then MPI and Slurm when ``auto_mpi_discovery``).
    No source at all gives ``DistEnv(0, 1, 0, None, port, "none")``."""
    found = _discover(environ, auto_mpi_discovery)
    port = _int(environ, "MASTER_PORT") or distributed_port
    if found is None and rank < 0 and world_size < 1:
        return DistEnv(0, 1, 0, None, port, "none")
    given = rank >= 0 or world_size >= 1
    final_rank = rank if rank >= 0 else (found.rank if found else -1)
    final_size = world_size if world_size >= 1 else (found.world_size if found else -1)
    if final_rank < 0 or final_size < 1:
        raise ValueError(f"got rank={rank} and world_size={world_size} but no launcher environment "
                         "supplies the other; pass both, or launch with deepshard/torchrun")
    if final_rank >= final_size:
        raise ValueError(f"rank {final_rank} is out of range for world size {final_size}; "
                         f"ranks run 0..{final_size - 1}")
    local_rank = _int(environ, "LOCAL_RANK")
    if local_rank is None and found is not None:
        local_rank = found.local_rank
    if local_rank is None:
        local_rank = final_rank if _fits_one_machine(found, final_size) else 0
    source = "args" if given else found.source  # type: ignore[union-attr]
    master = _master_addr(environ, found, final_size, init_method)
    return DistEnv(final_rank, final_size, local_rank, master, port, source)


def default_timeout(environ: Mapping[str, str]) -> datetime.timedelta:
    """The process-group timeout: ``DEEPSHARD_TIMEOUT`` or ``DEEPSPEED_TIMEOUT`` (minutes), else 10 min.
    The same setting bounds every wait of the library's collective watchdog (``comm/watchdog.py``)."""
    from deepshard.comm.settings import timeout_minutes  # here: deepshard.comm's package imports this module

    found = timeout_minutes(environ)
    return datetime.timedelta(minutes=found[1] if found is not None else DEFAULT_TIMEOUT_MINUTES)


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def hostname_is_usable(hostname: str | None = None) -> bool:
    """Whether ``hostname`` (default: this machine's) resolves to a non-loopback address this
    machine can bind, which is what gloo needs to pick its interface by itself."""
    try:
        infos = socket.getaddrinfo(hostname or socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        if _is_loopback(sockaddr[0]):
            continue
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False


def gloo_interface_for(master_addr: str) -> str | None:
    """The name of the network interface this machine uses to reach ``master_addr`` (the source
    address of that route, found with an unsent UDP ``connect``), or ``None`` when it is loopback or
    cannot be found."""
    import psutil

    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(master_addr, None, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((sockaddr[0], 9))  # UDP connect picks a route; no packet is sent
            local = probe.getsockname()[0]
    except OSError:
        return None
    if _is_loopback(local):
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == local for a in addresses):
            return name
    return None


def _choose_gloo_interface(env: DistEnv, backend: str) -> None:
    if backend != "gloo" or env.world_size == 1 or env.master_addr is None or "GLOO_SOCKET_IFNAME" in os.environ:
        return
    if _is_loopback(env.master_addr) or hostname_is_usable():
        return
    name = gloo_interface_for(env.master_addr)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        log_rank0(f"gloo: hostname {socket.gethostname()!r} is not a local address, so gloo would use "
                  f"loopback; using interface {name} (the route to MASTER_ADDR {env.master_addr}); set "
                  "GLOO_SOCKET_IFNAME to choose another", env.rank)


def _export(env: DistEnv) -> None:
    """Write the resolved values where ``torch.distributed``'s ``env://`` and user code look."""
    os.environ["RANK"] = str(env.rank)
    os.environ["WORLD_SIZE"] = str(env.world_size)
    os.environ["LOCAL_RANK"] = str(env.local_rank)
    os.environ["MASTER_PORT"] = str(env.master_port)
    if env.master_addr is not None:
        os.environ["MASTER_ADDR"] = env.master_addr


class DistNotInitializedError(RuntimeError, AssertionError):
    """``dist_init_required=False`` without an initialized ``torch.distributed`` (an AssertionError too, which
    is what DeepSpeed raises and code written for it catches)."""


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: object | None = None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Initialize ``torch.distributed`` (DeepSpeed's ``deepspeed.init_distributed`` signature).

    Does nothing when a default process group already exists. ``dist_init_required=False`` promises one
    exists (:class:`DistNotInitializedError` when it does not, as DeepSpeed asserts). The backend is ``dist_backend`` or the
    accelerator's (``gloo`` on CPU, ``nccl`` on CUDA); on CUDA the current device is set to the local
    rank first. ``timeout`` defaults to :func:`default_timeout`. A world of one process without
    ``init_method`` uses an in-memory store (no port). ``config`` is accepted for compatibility and
    unused.
    """
    import torch.distributed as dist

    from deepshard.accelerator import get_accelerator

    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build; install a build "
                           "with distributed support")
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise DistNotInitializedError(
            "init_distributed(dist_init_required=False) was told not to initialize torch.distributed, but it is not "
            "initialized; call torch.distributed.init_process_group first, or pass dist_init_required=True (or None)")
    env = resolve_dist_env(os.environ, rank, world_size, distributed_port, auto_mpi_discovery, init_method)
    if env.source != "none":
        _export(env)
    accelerator = get_accelerator(env.local_rank)
    accelerator.set_device()
    backend = dist_backend or accelerator.backend
    timeout = timeout if timeout is not None else default_timeout(os.environ)
    if init_method is None and env.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        where = "in-process store"
    else:
        if init_method is None or init_method == "env://":
            _choose_gloo_interface(env, backend)
        dist.init_process_group(backend, init_method=init_method or "env://", rank=env.rank,
                                world_size=env.world_size, timeout=timeout)
        where = init_method or f"{env.master_addr}:{env.master_port}"
    destroy_process_group_at_exit()
    if verbose:
        log_rank0(f"initialized torch.distributed: backend={backend}, world_size={env.world_size}, "
                  f"master={where} (from {env.source})", env.rank)


def get_local_rank() -> int:
    """This process's rank on its machine: ``LOCAL_RANK`` from the environment, else 0."""
    value = _int(os.environ, "LOCAL_RANK")
    return 0 if value is None else value
