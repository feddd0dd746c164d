"""Per-rank bodies for the DeepSpeed-style ``deepshard.comm`` module functions (run through the harness)."""
from __future__ import annotations

from typing import Any

import torch


def comm_api_world(rank: int, world: int) -> dict[str, Any]:
    """Every collective of ``deepshard.comm`` on known inputs; returns values to check against the
    closed forms, and the comms logger's counts."""
    from deepshard import comm
    from deepshard.accelerator import get_accelerator

    comm.init_distributed()  # already initialized by the harness: must be a no-op
    comm.COMMS_LOGGER.reset()
    out: dict[str, Any] = {"rank": comm.get_rank(), "world": comm.get_world_size(),
                           "local_rank": comm.get_local_rank(), "initialized": comm.is_initialized(),
                           "backend": comm.get_backend()}
    t = torch.full((4,), float(rank + 1))
    comm.all_reduce(t)
    out["sum"] = t.tolist()
    m = torch.tensor([float(rank)])
    comm.all_reduce(m, op=comm.ReduceOp.MAX)
    out["max"] = m.item()
    b = torch.full((3,), float(rank))
    comm.broadcast(b, src=world - 1)
    out["bcast"] = b.tolist()
    gathered = torch.empty(2 * world)
    comm.all_gather_into_tensor(gathered, torch.tensor([rank, 10.0 * rank]))
    out["gathered"] = gathered.tolist()
    full = torch.arange(2 * world, dtype=torch.float32) + rank
    mine = torch.empty(2)
    comm.reduce_scatter_tensor(mine, full)
    out["scattered"] = mine.tolist()
    pieces = [torch.empty(1) for _ in range(world)]
    comm.all_gather(pieces, torch.tensor([float(rank * rank)]))
    out["list_gathered"] = [p.item() for p in pieces]
    comm.barrier()
    out["counts"] = {op: (s.calls, s.elements) for op, s in comm.COMMS_LOGGER.ops.items()}
    summary = comm.log_summary(return_dict=True)
    out["in_summary"] = any(name.startswith("deepshard.comm#") and "all_reduce" in ops
                            for name, ops in summary.items())
    acc = get_accelerator()
    out["device"] = (acc.device_name(0), acc.current_device_name(), acc.communication_backend_name())
    return out
