"""Offload policies: where a kind of model state lives between uses (ZeRO-Offload, ZeRO-Infinity).

A policy is a frozen description built once from the config by :func:`make_offload_policies` and
handed to the ZeRO strategy, which asks :mod:`deepshard.zero.offload.factory` for the runtime objects
that implement it (the optimizer's shard states, the ZeRO-3 parameter store). Strategies never branch
on the policy themselves: they talk to those objects through one interface, as PyTorch FSDP2 does with
its ``OffloadPolicy`` / ``CPUOffloadPolicy``.

- :class:`NoOffload`: states stay on the compute device.
- :class:`CpuOffload`: states in (pinned) host memory, the optimizer step on the CPU. On a CPU-only
  machine the device *is* host memory, so the policy is inactive (``active=False``): nothing moves, and
  the strategy behaves exactly as without offload (logged once).
- :class:`NvmeOffload`: states in files under ``path``, read ahead and written behind by a pool of I/O
  threads (``aio`` settings) through a bounded pool of staging buffers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepshard.utils.logging import logger

# Run the CPU-offload machinery even where the device is the CPU (tests exercise the CUDA code path
# this way on machines without a GPU); not meant for users.
FORCE_CPU_OFFLOAD_ENV = "DEEPSHARD_OFFLOAD_CPU_ON_CPU"


@dataclass(frozen=True)
class AioSettings:
    """The ``aio`` section as the swapper uses it.

    ``block_size``: bytes per read/write request; ``queue_depth``: requests (whole tensor reads/writes)
    that may be outstanding before a new one waits; ``thread_count``: I/O worker threads, which split
    each request into ``block_size`` pieces between them."""

    block_size: int = 1 << 20
    queue_depth: int = 8
    thread_count: int = 1


@dataclass(frozen=True)
class OffloadPolicy:
    """Base class of the offload policies; ``device`` is the config's spelling."""

    device: str = "none"

    @property
    def moves_states(self) -> bool:
        """True when states leave the compute device's memory."""
        return False

    def describe(self) -> str:
        return "on the compute device"


@dataclass(frozen=True)
class NoOffload(OffloadPolicy):
    """States stay where the computation is."""


@dataclass(frozen=True)
class CpuOffload(OffloadPolicy):
    """States in host memory (pinned when ``pin_memory``); inactive where the device is the host."""

    device: str = "cpu"
    pin_memory: bool = True
    active: bool = True
    ratio: float = 1.0
    sub_group_size: int | None = None
    """``zero_optimization.sub_group_size`` when the config gives it; None: sized from memory
    (``sizing.py``)."""

    @property
    def moves_states(self) -> bool:
        return self.active

    def describe(self) -> str:
        return ("in pinned host memory" if self.pin_memory else "in host memory") if self.active else \
            "in host memory already (CPU run: cpu offload is a no-op)"


@dataclass(frozen=True)
class NvmeOffload(OffloadPolicy):
    """States in files under ``path`` (one directory per process, removed when the engine goes).

    ``buffer_count`` staging buffers bound what is resident: for the optimizer each buffer holds one
    tensor (master weights or one optimizer state) of one sub-group of ``sub_group_size`` elements.
    Both are None where the config leaves them out: the optimizer's states then size them from the
    shard and the host memory (``sizing.py``), because DeepSpeed's defaults (4 buffers of 1e9
    elements) would stage the whole shard several times over.
    ``buffer_size`` and ``max_in_cpu`` are DeepSpeed's parameter-offload keys (see docs/offload.md)."""

    device: str = "nvme"
    path: Path = field(default_factory=lambda: Path("."))
    buffer_count: int | None = None
    pin_memory: bool = True
    aio: AioSettings = field(default_factory=AioSettings)
    sub_group_size: int | None = None
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000

    @property
    def moves_states(self) -> bool:
        return True

    def describe(self) -> str:
        return f"on disk under {self.path}"


def aio_settings(aio_config: Any) -> AioSettings:
    """``aio.thread_count`` and its newer name ``aio.intra_op_parallelism``: the larger wins."""
    threads = max(int(getattr(aio_config, "thread_count", 1)), int(getattr(aio_config, "intra_op_parallelism", 1)))
    return AioSettings(block_size=int(aio_config.block_size), queue_depth=int(aio_config.queue_depth),
                       thread_count=threads)


def given(section: Any, key: str) -> int | None:
    """The section's ``key`` when the config sets it (not left out, not "auto"), else None."""
    if section is None or key not in getattr(section, "model_fields_set", ()):
        return None
    return int(getattr(section, key))


def _policy(section: Any, key: str, zero_config: Any, aio_config: Any, accelerator_kind: str) -> OffloadPolicy:
    device = str(getattr(section, "device", "none") or "none").lower() if section is not None else "none"
    if device == "none":
        return NoOffload()
    pin = bool(getattr(section, "pin_memory", True))
    if device == "cpu":
        forced = os.environ.get(FORCE_CPU_OFFLOAD_ENV, "") not in ("", "0")
        active = accelerator_kind != "cpu" or forced
        ratio = float(getattr(section, "ratio", 1.0))
        if active and ratio < 1.0:
            raise NotImplementedError(
                f"zero_optimization.{key}.ratio={ratio} (partial offload) is not implemented; use 1.0 to "
                "offload all optimizer states")
        return CpuOffload(pin_memory=pin and accelerator_kind == "cuda", active=active, ratio=ratio,
                          sub_group_size=given(zero_config, "sub_group_size"))
    if device == "nvme":
        path = getattr(section, "nvme_path", None)
        if not path:
            raise ValueError(f"zero_optimization.{key}.device is 'nvme' but nvme_path is not set; give the "
                             "directory to swap to, e.g. \"nvme_path\": \"/local_nvme\"")
        ratio = float(getattr(section, "ratio", 1.0))
        if ratio < 1.0:  # the same refusal as for cpu: never a silently ignored setting
            raise NotImplementedError(
                f"zero_optimization.{key}.ratio={ratio} (partial offload) is not implemented; use 1.0 to "
                "offload all of it")
        return NvmeOffload(
            path=Path(path), buffer_count=given(section, "buffer_count"),
            pin_memory=pin and accelerator_kind == "cuda", aio=aio_settings(aio_config),
            sub_group_size=given(zero_config, "sub_group_size"),
            buffer_size=int(getattr(section, "buffer_size", 100_000_000)),
            max_in_cpu=int(getattr(section, "max_in_cpu", 1_000_000_000)))
    raise ValueError(f"zero_optimization.{key}.device={device!r} is not one of 'none', 'cpu', 'nvme'")


def make_offload_policies(zero_config: Any, aio_config: Any, accelerator_kind: str, quiet: bool = False
                          ) -> tuple[OffloadPolicy, OffloadPolicy]:
    """``(optimizer_policy, param_policy)`` from ``zero_optimization`` and ``aio``.

    ``offload_param`` only means something at stage 3 (the config already warns at other stages);
    there it is a :class:`NoOffload`. Offload at stage 0 is refused by the plan check (``deepshard.plan``).
    ``quiet``: no log line (the plan check reads the policies too)."""
    stage = int(zero_config.stage)
    opt = _policy(zero_config.offload_optimizer, "offload_optimizer", zero_config, aio_config, accelerator_kind)
    param = _policy(zero_config.offload_param, "offload_param", zero_config, aio_config, accelerator_kind)
    if stage < 3:
        param = NoOffload()
    for key, policy in (("offload_optimizer", opt), ("offload_param", param)):
        if isinstance(policy, CpuOffload) and not policy.active and not quiet:
            logger.info("zero_optimization.%s.device=cpu: training already runs on the CPU, so model states "
                        "are in host memory; nothing to offload", key)
    return opt, param
