"""``deepspeed.launcher.multinode_runner``: DeepSpeed's multi-node runner classes, building deepshard's
commands. Each runner's ``get_cmd(environment, active_resources)`` returns the command deepshard's
launcher runs for that backend (:mod:`deepshard.launcher.multinode` plans it: one node agent per host,
through pdsh, mpirun or srun); ``PDSHRunner.get_cmd`` also returns the command that stops the job and the
environment pdsh needs, as DeepSpeed's does.

``args`` is a namespace from :func:`deepshard.compat.launcher_runner.parse_args`; ``world_info_base64`` the token
of :func:`deepshard.compat.launcher_runner.encode_world_info`; ``active_resources`` ``{host: slots}``, slots as
a count or a list.
"""
from __future__ import annotations

import re
import shutil
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["IMPIRunner", "MPICHRunner", "MVAPICHRunner", "MultiNodeRunner", "OpenMPIRunner", "PDSHRunner",
           "SlurmRunner"]

_PLAIN_VALUE = re.compile(r"^[\w@%+=:,./-]*$")


def _world(active_resources: Mapping[str, Any]) -> dict[str, list[int]]:
    return {host: list(range(slots)) if isinstance(slots, int) else list(slots)
            for host, slots in active_resources.items()}


def _master_addr(args: Any, world: Mapping[str, Sequence[int]]) -> str:
    return getattr(args, "master_addr", None) or next(iter(world))


class MultiNodeRunner(ABC):
    """One backend that starts the job on every node (DeepSpeed's base class and its ``exports``)."""

    launcher = ""
    """deepshard's ``--launcher`` name of the backend."""

    def __init__(self, args: Any, world_info_base64: str) -> None:
        self.args = args
        self.validate_args()
        self.user_arguments = self.parse_user_args()
        self.user_script = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: dict[str, str] = {}

    @abstractmethod
    def backend_exists(self) -> bool:
        """Whether the backend's program is installed here."""

    @abstractmethod
    def get_cmd(self, environment: dict[str, str], active_resources: Mapping[str, Any]) -> Any:
        """The command that starts the job on every node."""

    def add_export(self, key: str, var: str) -> None:
        """Export ``key=var`` to every rank; a value with shell-special characters is double-quoted."""
        value = var.strip()
        self.exports[key.strip()] = value if _PLAIN_VALUE.match(value) else f'"{value}"'

    def parse_user_args(self) -> list[str]:
        return list(self.args.user_args)

    @property
    def name(self) -> str:
        return type(self).__name__

    def validate_args(self) -> None:
        """Refuse arguments the backend cannot honour (nothing by default)."""

    @classmethod
    def validate_active_resources(cls, active_resources: Mapping[str, Any]) -> None:
        """Refuse an ``--include``/``--exclude`` selection the backend cannot express (none by default)."""

    def _plan_mpi(self, environment: dict[str, str], active_resources: Mapping[str, Any]) -> list[str]:
        from deepshard.launcher.multinode import plan_runners

        world = _world(active_resources)
        spec, = plan_runners(self.args, self.launcher, world, _master_addr(self.args, world), self.exports, environment,
                             "")
        return list(spec.cmd)


class PDSHRunner(MultiNodeRunner):
    """pdsh over ssh: one agent per host, ``%n`` its node rank."""

    launcher = "pdsh"

    def backend_exists(self) -> bool:
        return shutil.which("pdsh") is not None

    def get_cmd(self, environment: dict[str, str], active_resources: Mapping[str, Any]
                ) -> tuple[list[str], list[str], dict[str, str]]:
        import os

        from deepshard.launcher.multinode import plan_runners

        world = _world(active_resources)
        spec, = plan_runners(self.args, "pdsh", world, _master_addr(self.args, world), self.exports, environment,
                             os.getcwd())
        environment.update(spec.env)
        kill = ["pdsh", "-S", "-R", "ssh", "-w", ",".join(world), "pkill -f deepshard.launcher.node"]
        return list(spec.cmd), kill, environment


class OpenMPIRunner(MultiNodeRunner):
    """OpenMPI's ``mpirun``: one agent per host (it reads its node rank from ``OMPI_COMM_WORLD_RANK``)."""

    launcher = "openmpi"

    def __init__(self, args: Any, world_info_base64: str, resource_pool: Mapping[str, Any]) -> None:
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool

    def backend_exists(self) -> bool:
        return shutil.which("ompi_info") is not None

    def get_cmd(self, environment: dict[str, str], active_resources: Mapping[str, Any]) -> list[str]:
        return self._plan_mpi(environment, active_resources)


class MPICHRunner(OpenMPIRunner):
    """MPICH's ``mpirun`` (Hydra): one agent per host (``PMI_RANK``)."""

    launcher = "mpich"

    def backend_exists(self) -> bool:
        return shutil.which("mpirun") is not None


class IMPIRunner(MPICHRunner):
    """Intel MPI's ``mpirun`` (Hydra)."""

    launcher = "impi"


class MVAPICHRunner(MPICHRunner):
    """MVAPICH's ``mpirun`` (Hydra)."""

    launcher = "mvapich"

    def backend_exists(self) -> bool:
        return shutil.which("mpiname") is not None or shutil.which("mpirun") is not None


class SlurmRunner(OpenMPIRunner):
    """Slurm's ``srun``: one agent per node (``SLURM_PROCID``)."""

    launcher = "slurm"

    def backend_exists(self) -> bool:
        return shutil.which("sinfo") is not None
