"""Sequence parallelism under tensor parallelism: the attention gets one tensor-parallel rank's heads. Heads
that group (GQA included) are computed as without TP; heads that do not (tp did not divide the model's head
counts, and the plan check could not read them) are refused at the attention call with the tp and the fix."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepshard.comm.group import CommGroup
from deepshard.sp.api import SequenceParallel
from deepshard.sp.attention import SPGroups


def _sp(tp: int) -> SequenceParallel:
    one = CommGroup.single(name="sp")
    groups = SPGroups(sp=one, ulysses=one, ring=CommGroup.single(name="sp_ring"))
    return SequenceParallel(groups, mode="ulysses", tensor_parallel=tp)


def test_grouped_local_heads_under_tp_equal_plain_attention() -> None:
    """One tp rank's 2 query heads over 1 key/value head (4 over 2 at tp=2): plain causal attention."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 1, 5, 4, generator=g, dtype=torch.float64) for _ in range(2))
    got = _sp(tp=2).attention(q, k, v, seq_len=5)
    want = F.scaled_dot_product_attention(q, k.expand(-1, 2, -1, -1), v.expand(-1, 2, -1, -1), is_causal=True)
    assert (got - want).abs().max().item() < 1e-12


@pytest.mark.parametrize("hq, hk, hv", [(3, 2, 2), (2, 1, 2), (1, 2, 2)])
def test_heads_that_do_not_group_are_refused_with_tp_and_fix(hq: int, hk: int, hv: int) -> None:
    q, k, v = torch.zeros(1, hq, 4, 2), torch.zeros(1, hk, 4, 2), torch.zeros(1, hv, 4, 2)
    with pytest.raises(ValueError) as err:
        _sp(tp=2).attention(q, k, v, seq_len=4)
    text = str(err.value)
    for needle in ("sequence_parallel_size=1 with tensor parallelism (tp=2)", f"holds {hq} query heads",
                   f"{hk} key / {hv} value heads", "use a tensor-parallel size dividing both counts"):
        assert needle in text, text


def test_without_tp_the_attention_keeps_its_own_message() -> None:
    """tp=1: no tensor-parallel wording (the head plan's own error names the counts)."""
    with pytest.raises(ValueError, match="3 query heads cannot share 2 key/value heads"):
        _sp(tp=1).attention(torch.zeros(1, 3, 4, 2), torch.zeros(1, 2, 4, 2), torch.zeros(1, 2, 4, 2), seq_len=4)
