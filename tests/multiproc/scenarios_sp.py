"""Sequence-parallel scenarios (run by test_sp.py): each spawned world runs many checks and returns the
errors against one process."""
from __future__ import annotations

from typing import Any

import torch

from deepshard.sp import SequenceParallel
from deepshard.topology import ParallelDims, Topology

# (mode, ulysses_size, heads, kv_heads, seq_len, causal, balance)
ATTENTION_CASES_SP4 = [
    ("ulysses", None, 8, 4, 16, True, True),
    ("ulysses", None, 8, 2, 16, True, True),    # GQA: kv heads < sp, repeated
    ("ulysses", None, 6, 2, 13, True, True),    # uneven heads (padded) and length (padded, masked)
    ("ulysses", None, 5, 5, 15, False, True),   # non-causal: padding keys masked
    ("ring", None, 4, 2, 16, True, True),
    ("ring", None, 4, 2, 16, True, False),
    ("ring", None, 3, 1, 13, True, True),
    ("ring", None, 4, 4, 11, False, True),
    ("hybrid", 2, 6, 2, 16, True, True),        # 6 heads over a Ulysses pair, ring of 2
    ("hybrid", 2, 3, 1, 19, True, True),
]
ATTENTION_CASES_SP2 = [
    ("ulysses", None, 4, 2, 16, True, True),
    ("ulysses", None, 3, 3, 9, True, True),
    ("ring", None, 4, 2, 16, True, True),
    ("ring", None, 2, 1, 7, True, True),
]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _one_case(sp: SequenceParallel, case: tuple, seed: int) -> dict[str, float]:
    _, _, h, hk, s, causal, _ = case
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, s, 8, generator=g, dtype=torch.float64) for n in (h, hk, hk))
    dout = torch.randn(2, h, s, 8, generator=g, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = reference_attention(*full, causal)
    want.backward(dout)
    mine = [sp.shard(t, dim=2).clone().requires_grad_() for t in (q, k, v)]
    got = sp.attention(*mine, seq_len=s, causal=causal)
    got.backward(sp.shard(dout, dim=2))
    valid = sp.layout(s).positions(sp.rank) < s  # padded rows are nobody's tokens
    errors = {"out": float((got - sp.shard(want.detach(), dim=2))[:, :, valid].abs().max())}
    for name, a, b in zip("qkv", mine, full):
        errors[f"d{name}"] = float((a.grad - sp.shard(b.grad, dim=2))[:, :, valid].abs().max())
    return errors


def attention_world(rank: int, world: int) -> dict[str, Any]:
    """sp=4 (every mode) and dp=2 x sp=2 on one world of 4."""
    out: dict[str, Any] = {}
    topo4 = Topology.build(ParallelDims(sp=4))
    for i, case in enumerate(ATTENTION_CASES_SP4):
        sp = SequenceParallel.build(topo4, case[0], case[1], balance=case[6])
        out[("sp4",) + case] = _one_case(sp, case, seed=i)
    topo2 = Topology.build(ParallelDims(dp=2, sp=2))
    for i, case in enumerate(ATTENTION_CASES_SP2):
        sp = SequenceParallel.build(topo2, case[0], case[1], balance=case[6])
        out[("sp2",) + case] = _one_case(sp, case, seed=100 + i + topo2.coord.dp)
    out["labels"] = sorted(topo4.world.logger.ops)
    return out
