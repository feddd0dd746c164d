"""Per-rank bodies for the CommGroup collective tests (imported by spawned workers)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from deepshard.comm.group import CommGroup


def collectives_agree(rank: int, world: int, dtype_name: str) -> dict[str, Any]:
    """Pairwise reduce-scatter / all-gather / in-place all-gather vs closed-form expectations and vs
    gloo's native collectives, with several async calls in flight at once (tags must not mix)."""
    dtype = getattr(torch, dtype_name)
    pair, native = CommGroup(pairwise=True), CommGroup(pairwise=False)
    assert pair.pairwise and not native.pairwise
    chunk = 1000 + 7  # odd size: no accidental alignment

    def data_of(r: int) -> list[torch.Tensor]:  # every rank can rebuild every rank's input
        gen = torch.Generator().manual_seed(100 + r)
        return [torch.randn(chunk * world, generator=gen).to(dtype) for _ in range(3)]

    fulls = data_of(rank)
    everyone = [data_of(r) for r in range(world)]
    mine = slice(rank * chunk, (rank + 1) * chunk)
    exact_sums = [sum(parts[i].double() for parts in everyone)[mine] for i in range(3)]
    magnitudes = [sum(parts[i].double().abs() for parts in everyone)[mine] for i in range(3)]
    outs = [torch.empty(chunk, dtype=dtype) for _ in fulls]
    works = [pair.reduce_scatter_tensor(o, f.clone(), async_op=True) for o, f in zip(outs, fulls)]
    for w in works:
        w.wait()
    expected = []
    for f in fulls:
        ref = torch.empty(chunk, dtype=dtype)
        native.reduce_scatter_tensor(ref, f.clone())
        expected.append(ref)
    # reduce-scatter into a chunk of its own input (what the stage 1 reducer does)
    own = fulls[0].clone()
    pair.reduce_scatter_tensor(own[rank * chunk:(rank + 1) * chunk], own)
    # every rank contributes rank + 1 everywhere: the sum is exact in any dtype
    exact = torch.empty(chunk, dtype=dtype)
    pair.reduce_scatter_tensor(exact, torch.full((chunk * world,), float(rank + 1), dtype=dtype))
    shard = torch.arange(chunk, dtype=torch.float32).to(dtype) + 10_000 * rank
    gathered = torch.empty(chunk * world, dtype=dtype)
    pair.all_gather_into_tensor(gathered, shard)
    native_gathered = torch.empty(chunk * world, dtype=dtype)
    native.all_gather_into_tensor(native_gathered, shard)
    inplace = torch.zeros(chunk * world, dtype=dtype)
    inplace[rank * chunk:(rank + 1) * chunk] = shard
    pair.all_gather_inplace(inplace)
    # error relative to the sum of the magnitudes (cancellation makes the plain relative error unbounded)
    return {"rs_vs_exact": max(float(((o.double() - e) / m).abs().max())
                               for o, e, m in zip(outs, exact_sums, magnitudes)),
            "rs_vs_native": max(float((o.float() - e.float()).abs().max()) for o, e in zip(outs, expected)),
            "rs_own_vs_native": float((own[rank * chunk:(rank + 1) * chunk].float() - expected[0].float())
                                      .abs().max()),
            "rs_exact": bool(torch.all(exact == world * (world + 1) / 2)),
            "ag_equal_native": bool(torch.equal(gathered, native_gathered)),
            "ag_expected": bool(torch.equal(gathered, torch.cat([torch.arange(chunk, dtype=torch.float32).to(dtype)
                                                                  + 10_000 * r for r in range(world)]))),
            "ag_inplace": bool(torch.equal(inplace, gathered)),
            "backend": dist.get_backend()}


def pieces_reduce(rank: int, world: int, sizes: list[int], chunk: int, dtype_name: str,
                  pairwise: bool) -> dict[str, Any]:
    """reduce_scatter_pieces over pieces of uneven sizes (a piece may span chunks, the last chunk is
    padded) against the sum of every rank's concatenation, rebuilt from the seeds."""
    dtype = getattr(torch, dtype_name)
    comm = CommGroup(pairwise=pairwise)

    def pieces_of(r: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(7 + r)
        return [torch.randn(n, generator=gen).to(dtype) for n in sizes]

    works = [comm.reduce_scatter_pieces(pieces_of(rank), chunk) for _ in range(2)]  # two in flight
    for w in works:
        w.wait()
    total = torch.zeros(chunk * world, dtype=torch.float64)
    for r in range(world):
        flat = torch.cat([p.double() for p in pieces_of(r)])
        total[:flat.numel()] += flat
    expected = total[rank * chunk:(rank + 1) * chunk]
    return {"err": max(float((w.result.double() - expected).abs().max()) for w in works),
            "shape_ok": all(tuple(w.result.shape) == (chunk,) for w in works)}


PIECE_SIZES = [5, 1, 37, 0, 12]  # 55 elements: pieces cross chunk borders, one is empty


def every_comm_check(rank: int, world: int, pieces_native_too: bool) -> dict[str, Any]:
    """One world runs every check of tests/multiproc/test_comm.py for its size (a world per check cost a
    spawn each): the collectives in fp32 and bf16, and reduce_scatter_pieces pairwise (and natively when
    asked)."""
    chunk = -(-sum(PIECE_SIZES) // world) + 1  # a padded tail on the last rank
    out: dict[str, Any] = {dtype: collectives_agree(rank, world, dtype) for dtype in ("float32", "bfloat16")}
    for pairwise in (True, False) if pieces_native_too else (True,):
        out[f"pieces_pairwise={pairwise}"] = pieces_reduce(rank, world, PIECE_SIZES, chunk, "float32", pairwise)
    return out
