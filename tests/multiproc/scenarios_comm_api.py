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


def comm_api_rest_world(rank: int, world: int) -> dict[str, Any]:
    """The rest of DeepSpeed 0.19.8's ``deepspeed.comm`` functions, each next to torch.distributed's own
    call on the same inputs (the reference): objects, coalesced and batched collectives, group ranks, the
    logger's interval helpers and the launcher-environment readers."""
    import torch.distributed as dist

    from deepshard import comm

    out: dict[str, Any] = {}
    obj = {"rank": rank, "tag": "r" * (rank + 1)}
    ours, theirs = [None] * world, [None] * world
    comm.all_gather_object(ours, obj)
    dist.all_gather_object(theirs, obj)
    out["objects"] = (ours, theirs)

    inputs = [torch.full((2,), float(rank)), torch.arange(3.0) + 10 * rank]
    outs = [torch.empty(2 * world), torch.empty(3 * world)]
    comm.all_gather_coalesced(outs, inputs)
    refs = [torch.empty(2 * world), torch.empty(3 * world)]
    for ref, inp in zip(refs, inputs):
        dist.all_gather_into_tensor(ref, inp)
    handle = comm.all_gather_coalesced([torch.empty(2 * world)], [inputs[0]], async_op=True)
    out["gather_coalesced"] = ([o.tolist() for o in outs], [r.tolist() for r in refs], handle.wait())

    mine = [torch.full((2,), rank + 1.0), torch.full((3,), 2.0 * rank)]
    ref = [t.clone() for t in mine]
    comm.all_reduce_coalesced(mine)
    for t in ref:
        dist.all_reduce(t)
    out["reduce_coalesced"] = ([t.tolist() for t in mine], [t.tolist() for t in ref])

    peer = (rank + 1) % world
    source = (rank - 1) % world
    send, recv = torch.full((3,), float(rank)), torch.empty(3)
    for req in comm.batch_isend_irecv([comm.P2POp(comm.isend, send, peer), comm.P2POp(comm.irecv, recv, source)]):
        req.wait()
    ref_recv = torch.empty(3)
    for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, ref_recv, source)]):
        req.wait()
    out["p2p"] = (recv.tolist(), ref_recv.tolist())

    group = comm.new_group([world - 1])
    out["group_ranks"] = (comm.get_all_ranks_from_group(), comm.get_all_ranks_from_group(group),
                          dist.get_process_group_ranks(group))
    out["has"] = (comm.has_all_gather_into_tensor(), comm.has_reduce_scatter_tensor(),
                  comm.has_all_reduce_coalesced(), isinstance(comm.has_coalescing_manager(), bool))
    out["launcher"] = (comm.get_local_rank_from_launcher(), comm.get_world_rank_from_launcher(),
                       comm.get_world_size_from_launcher())
    comm.reset_log()
    before = comm.has_comm_data()
    comm.all_reduce(torch.ones(1))
    comm.barrier()
    out["log"] = (before, comm.has_comm_data(), comm.get_comm_operation_count(), sorted(comm.get_logged_comm_ops()))
    mesh = comm.initialize_mesh_device((world,), ("dp",))
    out["mesh"] = (tuple(mesh.mesh.shape), mesh.mesh_dim_names)
    backend = comm.TorchBackend("gloo")
    out["backend"] = (backend.name, backend.is_initialized(), backend.get_world_size())
    return out
