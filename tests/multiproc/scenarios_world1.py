"""One process, the whole engine: what ``test_device_world1.py`` runs in a single spawned world.

Under ``--device cuda`` this is the GPU with NCCL at world size 1 (``tests/multiproc/device.py``);
under ``--device cpu`` the same checks on the CPU, so they are known to pass before a GPU runs them.
"""
from __future__ import annotations

import os
from typing import Any

from deepshard.zero.offload.policy import FORCE_CPU_OFFLOAD_ENV
from tests.multiproc.device import device_kind, to_host
from tests.multiproc.scenarios_offload import _run, zero_section
from tests.multiproc.scenarios_pipe import check, train_pipeline
from tests.multiproc.scenarios_stage0 import checkpoint_world, oracle_world

# (name, stage, dtype, offload_optimizer device, offload_param device)
OFFLOAD_CASES = [("nvme-opt", 2, "bf16", "nvme", "none"), ("nvme-both", 3, "bf16", "nvme", "nvme"),
                 ("cpu-opt", 2, "bf16", "cpu", "none"), ("cpu-both", 3, "bf16", "cpu", "cpu")]


def offload_pairs(rank: int, world: int, tmp: str) -> dict[tuple[str, int, str], Any]:
    """Each offload case next to the same run without offload. On the CPU, "cpu" offload takes the
    path it takes on a GPU (pinned host states, the step on the host) only when forced."""
    forced = device_kind() == "cpu"
    if forced:
        os.environ[FORCE_CPU_OFFLOAD_ENV] = "1"
    try:
        out = {}
        for name, stage, dtype, opt, param in OFFLOAD_CASES:
            ref = _run(rank, world, stage, dtype, zero_section(stage))
            got = _run(rank, world, stage, dtype, zero_section(stage, opt, param, os.path.join(tmp, name)))
            out[(name, stage, dtype)] = (ref, got)
        return out
    finally:
        if forced:
            del os.environ[FORCE_CPU_OFFLOAD_ENV]


def world1(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """ZeRO 0-3 (fp32, SGD, bf16, fp16, a schedule) against the reference, checkpoint resume in fp32 and
    bf16, offload to host memory and to files, and a one-stage pipeline checked in the rank."""
    if world != 1:
        raise ValueError(f"world1 runs on one process, got a world of {world}")
    out: dict[str, Any] = {"device": device_kind()}
    out["oracle"] = {stage: to_host(oracle_world(rank, world, stage)) for stage in range(4)}
    out["checkpoint"] = {dtype: to_host(checkpoint_world(rank, world, os.path.join(tmp, f"ckpt-{dtype}"), dtype))
                         for dtype in ("fp32", "bf16")}
    out["offload"] = to_host(offload_pairs(rank, world, tmp))
    check(to_host(train_pipeline(1, "1f1b", 0, 2, steps=2)), 2, 2)
    out["pipeline"] = "pp1-1f1b-z0-m2"
    return out
