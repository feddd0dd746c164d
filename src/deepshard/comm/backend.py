"""DeepSpeed's communication-backend names in ``deepspeed.comm``: ``TorchBackend`` and the module functions
that pick or extend the backend (``set_backend``, ``init_deepspeed_backend``, ``initialize_mesh_device``,
``enable_symm_mem_for_group``, ``get_all_ranks_from_group``).

deepshard has one backend, ``torch.distributed`` with the accelerator's process-group backend (gloo on
CPU, NCCL on CUDA); DeepSpeed's oneCCL and MPI backends are not provided. :class:`TorchBackend` is that
backend as an object, for code that builds or inspects one."""
from __future__ import annotations

import datetime
from typing import Any, Optional

import torch.distributed as dist

import deepshard.comm.api as api

__all__ = ["TorchBackend", "enable_symm_mem_for_group", "get_all_ranks_from_group", "init_deepspeed_backend",
           "initialize_mesh_device", "set_backend"]


class TorchBackend:
    """``torch.distributed`` as DeepSpeed's backend object: constructing it initializes the default process
    group when there is none; the collectives are :mod:`deepshard.comm`'s (attributes fall through)."""

    def __init__(self, backend: str, timeout: datetime.timedelta | None = None, init_method: str | None = None,
                 rank: int = -1, world_size: int = -1, name: str = "torch") -> None:
        self.name = name
        self.backend = backend
        if not dist.is_initialized():
            from deepshard.distributed import init_distributed

            init_distributed(backend, timeout=timeout, init_method=init_method, rank=rank, world_size=world_size)
        self.using_mpi = dist.get_backend() == "mpi"
        self.initialized = True

    def is_initialized(self) -> bool:
        return dist.is_initialized()

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(api, name)
        except AttributeError:
            raise AttributeError(f"TorchBackend has no attribute {name!r}") from None


def set_backend() -> None:
    """DeepSpeed chooses among its backends here; deepshard's is always ``torch.distributed`` (nothing to
    choose), so after this call, as before it, collectives go through torch."""


def init_deepspeed_backend(ds_backend: str, timeout: Any, init_method: Any) -> None:
    """Unused in DeepSpeed 0.19.8 as in deepshard (the name is kept for code that imports it)."""


def get_all_ranks_from_group(group: Optional[dist.ProcessGroup] = None) -> list[int]:
    """The world ranks of ``group``'s members, in group-rank order (the world when None)."""
    if group is None:
        return list(range(api.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def initialize_mesh_device(mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...]) -> Any:
    """A ``torch.distributed`` ``DeviceMesh`` of ``mesh_shape`` over the world, on this process's device."""
    from torch.distributed.device_mesh import init_device_mesh

    from deepshard.accelerator import get_accelerator

    return init_device_mesh(get_accelerator().device.type, tuple(mesh_shape), mesh_dim_names=tuple(mesh_dim_names))


def enable_symm_mem_for_group(group_name: str) -> Any:
    """Turn on torch's symmetric memory for the process group named ``group_name`` (CUDA only)."""
    try:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group as enable
    except ImportError as exc:
        raise RuntimeError(f"this torch build has no symmetric memory ({exc}); it needs a CUDA build of "
                           "torch >= 2.5") from None
    return enable(group_name)
