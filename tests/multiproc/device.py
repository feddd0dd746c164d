"""Which device the multi-process tests run on: the CPU (the default, and all CI has) or a CUDA GPU.

``pytest --device cuda`` (tests/conftest.py) sets ``DEEPSHARD_TEST_DEVICE=cuda`` before any world is
spawned. Then every rank runs with ``DEEPSHARD_ACCELERATOR=cuda`` on GPU ``LOCAL_RANK % device_count``,
a world of one process uses NCCL (the backend deepshard itself picks on CUDA, so the scenarios' own
bookkeeping collectives must use device tensors too), and a larger world uses gloo, which takes CUDA
tensors for the collectives it implements for them (one GPU cannot hold two NCCL ranks). Results
are moved to the host before they leave the rank, and a rank that never allocated CUDA memory is
reported as not having run on the GPU. Without the option nothing changes: CPU and gloo.
"""
from __future__ import annotations

import os
from typing import Any

import torch

ENV = "DEEPSHARD_TEST_DEVICE"
KINDS = ("cpu", "cuda")


def device_kind() -> str:
    """``"cpu"`` unless the suite was started with ``--device cuda``."""
    kind = os.environ.get(ENV, "cpu") or "cpu"
    if kind not in KINDS:
        raise ValueError(f"{ENV}={kind!r} is not a test device; use one of: {', '.join(KINDS)}")
    return kind


def rank_device() -> torch.device:
    """The device a rank's batches go to: ``cpu``, or this rank's GPU under ``--device cuda``."""
    if device_kind() == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def world_backend(world_size: int) -> str:
    """The process-group backend of a test world (see the module docstring)."""
    if device_kind() == "cpu":
        return "gloo"
    return "nccl" if world_size == 1 else "gloo"


def to_host(value: Any) -> Any:
    """``value`` with every tensor inside (lists, tuples, dicts) moved to the CPU; other objects as they are."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if value.device.type != "cpu" else value
    if isinstance(value, dict):
        return {k: to_host(v) for k, v in value.items()}
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(to_host(v) for v in value)
    if isinstance(value, list):
        return [to_host(v) for v in value]
    return value
