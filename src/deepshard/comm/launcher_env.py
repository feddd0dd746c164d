"""Where a process learns its rank from the launcher that started it: DeepSpeed's ``deepspeed.comm``
helpers of these names (``get_*_from_launcher``, the cluster checks ``in_aml`` / ``in_aws_sm`` /
``in_dlts``, the Azure ML and SageMaker environment patches, ``mpi_discovery``). They read and write
environment variables only; :func:`deepshard.distributed.init_distributed` does the same discovery itself."""
from __future__ import annotations

import os

from deepshard.utils.logging import logger

DEFAULT_AML_MASTER_PORT = "54965"
DEFAULT_AML_NCCL_SOCKET_IFNAME = "^docker0,lo"

__all__ = ["get_local_rank_from_launcher", "get_world_rank_from_launcher", "get_world_size_from_launcher",
           "in_aml", "in_aws_sm", "in_dlts", "mpi_discovery", "patch_aml_env_for_torch_nccl_backend",
           "patch_aws_sm_env_for_torch_nccl_backend"]


def _first_int(names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer; fix or unset it") from None
    return default


def get_local_rank_from_launcher() -> int:
    """``LOCAL_RANK`` (DeepSpeed's and deepshard's launchers, torchrun), else OpenMPI's, else 0."""
    return _first_int(("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"), 0)


def get_world_rank_from_launcher() -> int:
    """``RANK``, else OpenMPI's ``OMPI_COMM_WORLD_RANK``, else 0."""
    return _first_int(("RANK", "OMPI_COMM_WORLD_RANK"), 0)


def get_world_size_from_launcher() -> int:
    """``WORLD_SIZE``, else OpenMPI's ``OMPI_COMM_WORLD_SIZE``, else 1."""
    return _first_int(("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"), 1)


def in_aml() -> bool:
    """Whether this runs in an Azure Machine Learning job."""
    return "AZUREML_EXPERIMENT_ID" in os.environ


def in_aws_sm() -> bool:
    """Whether this runs in an AWS SageMaker training job."""
    return "SM_TRAINING_ENV" in os.environ


def in_dlts() -> bool:
    """Whether this runs on a DLTS cluster."""
    return "DLTS_JOB_ID" in os.environ


def _require(names: tuple[str, ...], where: str) -> None:
    missing = [n for n in names if n not in os.environ]
    if missing:
        raise KeyError(f"{where} needs the environment variables {missing}, which the job did not set; "
                       "launch under its MPI launcher or set RANK/WORLD_SIZE/LOCAL_RANK yourself")


def patch_aml_env_for_torch_nccl_backend(master_port: int = 6105, verbose: bool = True) -> None:
    """Turn Azure ML's OpenMPI variables into ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/
    ``MASTER_PORT`` (the master from ``AZ_BATCH_MASTER_NODE`` on several nodes,
    ``AZ_BATCHAI_MPI_MASTER_NODE`` on one) and keep NCCL off the docker and loopback interfaces."""
    _require(("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
              "OMPI_COMM_WORLD_LOCAL_RANK"), "patch_aml_env_for_torch_nccl_backend")
    os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
    os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
    if int(os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"]) != int(os.environ["WORLD_SIZE"]):
        os.environ["MASTER_ADDR"] = os.environ["AZ_BATCH_MASTER_NODE"].split(":")[0]
        os.environ.setdefault("MASTER_PORT", str(master_port))
    else:
        os.environ["MASTER_ADDR"] = os.environ["AZ_BATCHAI_MPI_MASTER_NODE"]
        os.environ["MASTER_PORT"] = DEFAULT_AML_MASTER_PORT
    if verbose:
        logger.info("NCCL_SOCKET_IFNAME original value = %s", os.environ.get("NCCL_SOCKET_IFNAME"))
    os.environ["NCCL_SOCKET_IFNAME"] = DEFAULT_AML_NCCL_SOCKET_IFNAME
    os.environ["LOCAL_RANK"] = os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]
    if verbose:
        _log_discovered("AzureML")


def patch_aws_sm_env_for_torch_nccl_backend(verbose: bool = True) -> None:
    """Turn SageMaker's OpenMPI variables into ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``."""
    _require(("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
             "patch_aws_sm_env_for_torch_nccl_backend")
    os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
    os.environ["LOCAL_RANK"] = os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]
    os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
    if verbose:
        _log_discovered("AWS SageMaker")


def mpi_discovery(distributed_port: int = 29500, verbose: bool = True) -> None:
    """Set ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` from the MPI job this
    process belongs to (through ``mpi4py``, as DeepSpeed: rank 0's address is broadcast; local ranks count
    the earlier ranks on the same host). deepshard's ``init_distributed`` needs no such call: it reads the
    MPI launchers' variables itself."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError("mpi_discovery needs mpi4py (pip install mpi4py); deepshard.init_distributed "
                          "reads OpenMPI/MVAPICH/MPICH/Slurm variables without it") from exc
    import socket

    comm = MPI.COMM_WORLD
    rank, world_size = comm.Get_rank(), comm.Get_size()
    master_addr = comm.bcast(socket.gethostbyname(socket.gethostname()) if rank == 0 else None, root=0)
    hosts = comm.allgather(MPI.Get_processor_name())
    local_rank = sum(1 for host in hosts[:rank] if host == hosts[rank])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                      MASTER_ADDR=master_addr, MASTER_PORT=str(distributed_port))
    if verbose:
        _log_discovered("MPI")


def _log_discovered(source: str) -> None:
    logger.info("Discovered %s settings of world_rank=%s, local_rank=%s, world_size=%s, master_addr=%s, "
                "master_port=%s", source, os.environ.get("RANK"), os.environ.get("LOCAL_RANK"),
                os.environ.get("WORLD_SIZE"), os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
