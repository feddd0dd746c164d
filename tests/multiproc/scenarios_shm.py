"""Per-rank bodies for the shared-memory transport tests (tests/multiproc/test_shm.py): every collective
over shared memory against the pairwise TCP path and against a reference computed locally, bit for bit."""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from deepshard.comm import settings, shm
from deepshard.comm.group import CommGroup
from deepshard.comm.watchdog import CollectiveTimeout

SLOT_MB = "0.015625"  # 16 KiB slots: the larger tensors below take several rounds
SIZES = [5, 1, 37, 0, 12, 20_000, 3]  # pieces cross chunk (and round) borders, one is empty
DTYPES = ("float32", "bfloat16", "float16")


def _pieces(r: int, dtype: torch.dtype, salt: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * salt + r)
    return [torch.randn(n, generator=gen).to(dtype) for n in SIZES]


def _reference_rs(rank: int, size: int, dtype: torch.dtype, chunk: int, salt: int) -> torch.Tensor:
    """Chunk ``rank`` of the sum in the canonical order, whichever rank owns the chunk: a binary tree over
    the ranks, each span split after its largest power of two (4 ranks: ``(c0 + c1) + (c2 + c3)``; 3:
    ``(c0 + c1) + c2``); 16-bit over more than two ranks summed in fp32, rounded once."""
    wide = size > 2 and dtype.itemsize < 4

    def padded(r: int) -> torch.Tensor:
        flat = torch.zeros(size * chunk, dtype=dtype)
        cat = torch.cat(_pieces(r, dtype, salt))
        flat[:cat.numel()] = cat
        own = flat[rank * chunk:(rank + 1) * chunk]
        return own.float() if wide else own

    def tree(lo: int, hi: int) -> torch.Tensor:
        if hi - lo == 1:
            return padded(lo)
        half = 1
        while half * 2 < hi - lo:
            half *= 2
        return tree(lo, lo + half) + tree(lo + half, hi)

    return tree(0, size).to(dtype)


def _compare(mem: CommGroup, tcp: CommGroup, dtype: torch.dtype, salt: int) -> dict[str, bool]:
    """Every collective on ``mem`` (shared memory) vs ``tcp`` and vs the local reference, several in flight."""
    rank, size = mem.rank, mem.size
    chunk = -(-sum(SIZES) // size) + 3  # a padded tail on the last rank
    works = [g.reduce_scatter_pieces(_pieces(rank, dtype, salt + i), chunk) for i in range(2) for g in (mem, tcp)]
    for w in works:
        w.wait()
    out = {"rs_pieces_vs_tcp": all(torch.equal(works[2 * i].result, works[2 * i + 1].result) for i in range(2)),
           "rs_pieces_vs_ref": all(torch.equal(works[2 * i].result, _reference_rs(rank, size, dtype, chunk, salt + i))
                                   for i in range(2))}
    full = torch.cat(_pieces(rank, dtype, salt))[:size * (sum(SIZES) // size)].contiguous()
    n = full.numel() // size
    a, b = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
    mem.reduce_scatter_tensor(a, full)
    tcp.reduce_scatter_tensor(b, full)
    own = full.clone()  # in place: the output is this rank's chunk of the input
    mem.reduce_scatter_tensor(own[rank * n:(rank + 1) * n], own)
    out["rs_tensor"] = torch.equal(a, b) and torch.equal(own[rank * n:(rank + 1) * n], b)
    shard = torch.cat(_pieces(rank, dtype, salt + 7))
    expected = torch.cat([torch.cat(_pieces(r, dtype, salt + 7)) for r in range(size)])
    got, ref = torch.empty_like(expected), torch.empty_like(expected)
    w1 = mem.all_gather_into_tensor(got, shard, async_op=True)
    w2 = tcp.all_gather_into_tensor(ref, shard, async_op=True)
    w1.wait(), w2.wait()
    inplace = torch.zeros_like(expected)
    inplace.view(size, -1)[rank].copy_(shard)
    mem.all_gather_inplace(inplace)
    out["all_gather"] = torch.equal(got, expected) and torch.equal(ref, expected) and torch.equal(inplace, expected)
    return out


def _pair(group: Optional[dist.ProcessGroup], name: str) -> tuple[CommGroup, CommGroup]:
    return (CommGroup(group=group, name=name, pairwise=True, shm=True),
            CommGroup(group=group, name=name, pairwise=True, shm=False))


def _all_cases(mem: CommGroup, tcp: CommGroup) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for salt, dtype_name in enumerate(DTYPES):
        res.update({f"{dtype_name}:{k}": v for k, v in _compare(mem, tcp, getattr(torch, dtype_name), 10 * salt).items()})
    link = mem.transport.link
    res["used_shm"] = link is not None and link.state == "shm" and tcp.transport.kind == "pairwise"
    res["paths"] = link.paths if link is not None else []
    return res


def _fallback(rank: int) -> dict[str, Any]:
    """Ranks on "different hosts": the group keeps TCP and the results are still right."""
    os.environ[shm.HOST_VAR] = f"host-{rank}"
    try:
        mem, tcp = _pair(None, "world")
        res = _compare(mem, tcp, torch.float32, 99)
    finally:
        del os.environ[shm.HOST_VAR]
    res["fell_back"] = mem.transport.link is not None and mem.transport.link.state == "tcp"
    return res


def _timeout(rank: int, barrier: CommGroup) -> str:
    """Rank 0 gathers alone under a 3 s timeout: its error names the rank that did not arrive."""
    os.environ["DEEPSHARD_TIMEOUT"] = "0.05"
    try:
        mem = CommGroup(name="late", shm=True)
        mem.all_gather_into_tensor(torch.empty(2 * mem.size), torch.ones(2))  # rendezvous, watchdog made
    finally:
        del os.environ["DEEPSHARD_TIMEOUT"]
    message = ""
    if rank == 0:
        try:
            mem.all_gather_into_tensor(torch.empty(2 * mem.size), torch.ones(2))
        except CollectiveTimeout as err:
            message = str(err)
    barrier.barrier()
    return message


def _mismatch(rank: int) -> str:
    """Rank 0 all-gathers while the others reduce-scatter the same bytes: both raise, naming the others."""
    mem = CommGroup(name="mismatch", shm=True)
    mem.all_gather_into_tensor(torch.empty(mem.size), torch.ones(1))
    try:
        if rank == 0:
            mem.all_gather_into_tensor(torch.empty(4 * mem.size), torch.ones(4))
        else:
            mem.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * mem.size))
    except CollectiveTimeout as err:
        return str(err)
    return ""


def every_shm_check(rank: int, world: int, grid: bool, failures: bool) -> dict[str, Any]:
    """One world runs every check of its size: the collectives over the world (and over the dp groups of a
    2x2 grid), the fallback, and (``failures``) a peer that never arrives and mismatched collectives."""
    os.environ[settings.SLOT_VAR] = SLOT_MB
    out: dict[str, Any] = {"world": _all_cases(*_pair(None, "world"))}
    if grid:
        groups = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])]
        out["dp"] = _all_cases(*_pair(groups[rank % 2], "dp"))
    out["fallback"] = _fallback(rank)
    if failures:
        out["timeout"] = _timeout(rank, CommGroup(shm=False))
        out["mismatch"] = _mismatch(rank)
    out["leftover"] = [p for p in out["world"]["paths"] + out.get("dp", {}).get("paths", []) if os.path.exists(p)]
    return out
