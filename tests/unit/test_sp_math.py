"""Sequence parallelism's pure parts: the token layout (head-tail chunks), head plans, the online-softmax
merge and the block backward, against plain attention in one piece."""
from __future__ import annotations

import pytest
import torch

from deepshard.comm.group import CommGroup
from deepshard.sp.heads import head_plan
from deepshard.sp.layout import SeqLayout, causal_work
from deepshard.sp.ring import ring_attention
from deepshard.sp.softmax_merge import allowed_mask, block_backward, block_forward, merge


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        seq_len: int | None = None) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    if causal:
        allowed = torch.tril(allowed)
    if seq_len is not None:
        allowed[:, seq_len:] = False
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


def test_layout_head_tail_chunks_and_round_trip() -> None:
    layout = SeqLayout(seq_len=16, ring=2, ulysses=1)
    assert layout.positions(0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert layout.positions(1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    hybrid = SeqLayout(seq_len=16, ring=2, ulysses=2)
    assert [hybrid.positions(r).tolist() for r in range(4)] == [[0, 1, 2, 3], [12, 13, 14, 15],
                                                                [4, 5, 6, 7], [8, 9, 10, 11]]
    assert SeqLayout(seq_len=16, ring=2, balance=False).positions(0).tolist() == list(range(8))
    uneven = SeqLayout(seq_len=13, ring=1, ulysses=4)
    assert uneven.padded_len == 16 and uneven.local_len == 4
    x = torch.arange(2 * 13).reshape(2, 13)
    pieces = [uneven.shard(x, r) for r in range(4)]
    assert pieces[3][0].tolist() == [12, 0, 0, 0]  # padded at the end
    assert torch.equal(uneven.unshard(pieces), x)
    balanced = SeqLayout(seq_len=13, ring=4)
    assert torch.equal(balanced.unshard([balanced.shard(x, r) for r in range(4)]), x)


def test_head_tail_chunks_balance_causal_work() -> None:
    assert len(set(causal_work(SeqLayout(seq_len=64, ring=4)))) == 1  # every rank the same work
    plain = causal_work(SeqLayout(seq_len=64, ring=4, balance=False))
    assert max(plain) > 3 * min(plain)  # contiguous chunks: the last rank does most of the work


@pytest.mark.parametrize("h,hk,n,repeat,pad", [(8, 4, 4, 1, 0), (8, 2, 4, 2, 0), (8, 1, 4, 4, 0),
                                               (6, 2, 4, 3, 2), (6, 6, 4, 1, 2), (3, 1, 2, 3, 1)])
def test_head_plan(h: int, hk: int, n: int, repeat: int, pad: int) -> None:
    plan = head_plan(h, hk, n)
    assert (plan.kv_repeat, plan.pad) == (repeat, pad)
    assert (h + plan.pad) % n == 0 and (hk * plan.kv_repeat + plan.pad) % n == 0


def test_merge_of_two_key_blocks_is_attention_over_both() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    want = reference_attention(q, k, v, causal=False)
    first = block_forward(q, k[:, :, :4], v[:, :, :4], None, 8 ** -0.5)
    second = block_forward(q, k[:, :, 4:], v[:, :, 4:], None, 8 ** -0.5)
    out, _ = merge(*first, *second)
    assert torch.allclose(out, want, atol=1e-6)
    hidden = torch.zeros(5, 4, dtype=torch.bool)  # a block the mask hides entirely changes nothing
    out2, lse2 = merge(out, merge(*first, *second)[1], *block_forward(q, k[:, :, :4], v[:, :, :4], hidden, 1.0))
    assert torch.allclose(out2, want, atol=1e-6) and torch.isfinite(lse2).all()


@pytest.mark.parametrize("causal,seq_len,budget", [(True, 12, None), (False, 12, None), (True, 10, None),
                                                   (False, 9, None), (True, 11, 50)])
def test_block_attention_forward_and_backward_match_autograd(causal: bool, seq_len: int, budget: int | None,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    if budget is not None:  # query rows in slices of 50 // (12 keys x 2 heads x 2 batch) = 1 row
        monkeypatch.setattr("deepshard.sp.softmax_merge.ROW_BUDGET", budget)
    torch.manual_seed(1)
    q = torch.randn(2, 4, 12, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 12, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 12, 8, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 4, 12, 8, dtype=torch.float64)
    want = reference_attention(q, k, v, causal, seq_len)
    want.backward(dout)
    pos = torch.arange(12)
    single = CommGroup.single(name="sp_ring")
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    got = ring_attention(qq, kk, vv, single, [pos], causal=causal, seq_len=seq_len)
    got.backward(dout)
    assert torch.allclose(got, want, atol=1e-10)
    for a, b in ((qq, q), (kk, k), (vv, v)):
        assert torch.allclose(a.grad, b.grad, atol=1e-10)
    # the split form: two key blocks, merged forward, summed backward
    allowed = [allowed_mask(pos, pos[:6], causal, seq_len), allowed_mask(pos, pos[6:], causal, seq_len)]
    parts = [block_forward(q.detach(), k.detach()[:, :, s], v.detach()[:, :, s], a, 8 ** -0.5)
             for s, a in zip((slice(0, 6), slice(6, 12)), allowed)]
    out, lse = merge(*parts[0], *parts[1])
    delta = (dout * out).sum(-1)
    dq = sum(block_backward(q.detach(), k.detach()[:, :, s], v.detach()[:, :, s], a, 8 ** -0.5, lse, dout, delta)[0]
             for s, a in zip((slice(0, 6), slice(6, 12)), allowed))
    assert torch.allclose(dq, q.grad, atol=1e-10)


def segment_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """Causal attention where a query sees only keys of its segment (``seg`` [b, s]; -1: never attended to).
    A query of segment -1 attends to itself only (its output is nobody's: the tests give it no gradient)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q.shape[2]
    allowed = torch.tril(torch.ones(s, s, dtype=torch.bool)) & (seg.unsqueeze(-1) == seg.unsqueeze(1)) & \
        (seg >= 0).unsqueeze(1)
    allowed = allowed | ((seg < 0).unsqueeze(-1) & torch.eye(s, dtype=torch.bool))
    scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~allowed.unsqueeze(1), float("-inf"))
    return torch.softmax(scores, -1) @ v


def test_segment_ids_from_packed_positions_and_padding() -> None:
    from deepshard.sp.softmax_merge import segment_ids

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    assert segment_ids(pos).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert segment_ids(torch.arange(8).unsqueeze(0)) is None  # one document: plain causal attention
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1]])
    assert segment_ids(None, mask).tolist() == [[-1, -1, 0, 0, 0, -1, 0, 0]]
    assert segment_ids(None, torch.ones(1, 8)) is None


@pytest.mark.parametrize("budget", [None, 7])
def test_packed_and_padded_attention_matches_a_masked_reference(budget: int | None, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """Packed documents (segments) and padding inside a sequence, forward and backward, GQA, in row slices."""
    import deepshard.sp.softmax_merge as sm

    if budget is not None:
        monkeypatch.setattr(sm, "ROW_BUDGET", budget)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, n, 11, 4, generator=g, dtype=torch.float64, requires_grad=True) for n in (4, 2, 2))
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2], [-1, -1, 0, 0, 0, -1, 0, 0, 0, 0, -1]])
    dout = torch.randn(2, 4, 11, 4, generator=g, dtype=torch.float64) * (seg >= 0).unsqueeze(1).unsqueeze(-1)
    want = segment_reference(q, k, v, seg)
    grads = torch.autograd.grad(want, (q, k, v), dout)
    got = ring_attention(q, k, v, CommGroup.single(name="sp_ring"), [torch.arange(11)], causal=True, segments=seg)
    mine = torch.autograd.grad(got, (q, k, v), dout)
    valid = (seg >= 0).unsqueeze(1).unsqueeze(-1)
    assert torch.allclose(got * valid, want * valid, atol=1e-12)
    for a, b in zip(mine, grads):
        assert torch.allclose(a, b, atol=1e-12)


def test_positional_dropout_mask_follows_the_token_not_the_layout() -> None:
    """The mask of a token is the same whichever slice holds it (any layout), and in one piece."""
    from deepshard.sp.dropout import BLOCK, positional_dropout

    x = torch.ones(2, 3 * BLOCK + 5, 4)
    torch.manual_seed(7)
    whole = positional_dropout(x, 0.3, torch.arange(x.shape[1]))
    for layout in (SeqLayout(x.shape[1], ring=4), SeqLayout(x.shape[1], ulysses=3), SeqLayout(x.shape[1], ring=2, ulysses=2)):
        for rank in range(layout.sp):
            torch.manual_seed(7)
            mine = layout.positions(rank)
            real = mine < x.shape[1]
            got = positional_dropout(x[:, mine[real]], 0.3, mine[real])
            assert torch.equal(got, whole[:, mine[real]])
    kept = float((whole != 0).float().mean())
    assert abs(kept - 0.7) < 0.02 and torch.allclose(whole[whole != 0], torch.tensor(1 / 0.7))
    torch.manual_seed(7)
    positional_dropout(x, 0.3, torch.arange(x.shape[1]))
    assert not torch.equal(positional_dropout(x, 0.3, torch.arange(x.shape[1])), whole)  # the next call differs


def test_plain_blocks_take_torchs_fused_kernel_and_match_the_reference_with_gqa() -> None:
    """fp32 on the CPU: a causal diagonal block and a fully visible block run torch's flash kernel; their
    merge and the summed backward (the kernel reading the merged out and lse) equal plain attention."""
    from deepshard.sp.softmax_merge import _flash_causal

    torch.manual_seed(2)
    q64 = torch.randn(2, 4, 12, 8, dtype=torch.float64, requires_grad=True)
    k64 = torch.randn(2, 2, 12, 8, dtype=torch.float64, requires_grad=True)
    v64 = torch.randn(2, 2, 12, 8, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 4, 12, 8, dtype=torch.float64)
    want = reference_attention(q64, k64, v64, causal=True)
    want.backward(dout)
    q, k, v, d32 = (t.detach().float() for t in (q64, k64, v64, dout))
    pos = torch.arange(12)
    # queries 6..11 against keys 0..5 (all visible) and against keys 6..11 (the causal diagonal)
    off, diag = allowed_mask(pos[6:], pos[:6], True, 12), allowed_mask(pos[6:], pos[6:], True, 12)
    assert _flash_causal(q[:, :, 6:], k[:, :, :6], v[:, :, :6], off) is False
    assert _flash_causal(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], diag) is True
    assert _flash_causal(q64, k64, v64, diag) is None  # fp64: computed here
    head_tail = allowed_mask(torch.tensor([0, 1, 10, 11]), torch.tensor([0, 1, 10, 11]), True, 12)
    assert _flash_causal(q[:, :, :4], k[:, :, :4], v[:, :, :4], head_tail) is True  # increasing positions
    padded = allowed_mask(pos, pos, True, 10)
    assert _flash_causal(q, k, v, padded) is None
    blocks = [(slice(0, 6), off), (slice(6, 12), diag)]
    parts = [block_forward(q[:, :, 6:], k[:, :, s], v[:, :, s], a, 8 ** -0.5) for s, a in blocks]
    out, lse = merge(*parts[0], *parts[1])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want[:, :, 6:].float(), atol=2e-6, rtol=1e-5)
    delta = (d32[:, :, 6:] * out).sum(-1)
    grads = [block_backward(q[:, :, 6:], k[:, :, s], v[:, :, s], a, 8 ** -0.5, lse, d32[:, :, 6:], delta, out)
             for s, a in blocks]
    # only queries 6..11 were computed: compare with the reference restricted to them
    q_r, k_r, v_r = (t.detach().clone().requires_grad_() for t in (q64, k64, v64))
    reference_attention(q_r, k_r, v_r, causal=True)[:, :, 6:].backward(dout[:, :, 6:])
    torch.testing.assert_close(grads[0][0] + grads[1][0], q_r.grad[:, :, 6:].float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([grads[0][1], grads[1][1]], 2), k_r.grad.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([grads[0][2], grads[1][2]], 2), v_r.grad.float(), atol=1e-5, rtol=1e-5)


def test_head_tail_blocks_are_cut_into_runs_and_match_the_reference() -> None:
    """A ring rank's head-tail chunk against another rank's: cut where positions jump, every pair is hidden,
    fully visible or diagonal (the fused kernel); forward and backward equal plain causal attention."""
    from deepshard.sp.softmax_merge import _run_pairs

    torch.manual_seed(3)
    q64, k64, v64 = (torch.randn(1, 4, 8, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mine, other = torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5])  # ring of 2, head-tail layout
    dout = torch.randn(1, 4, 4, 8, dtype=torch.float64)
    reference_attention(q64, k64, v64, causal=True)[:, :, mine].backward(dout)
    q, k, v, d32 = (t.detach().float() for t in (q64, k64, v64, dout))
    qm = q[:, :, mine]
    blocks = [(mine, allowed_mask(mine, mine, True, 8)), (other, allowed_mask(mine, other, True, 8))]
    assert _run_pairs(qm, k[:, :, other], v[:, :, other], blocks[1][1]) is not None
    parts = [block_forward(qm, k[:, :, pos], v[:, :, pos], a, 8 ** -0.5) for pos, a in blocks]
    out, lse = merge(*parts[0], *parts[1])
    torch.testing.assert_close(out, reference_attention(q64, k64, v64, True)[:, :, mine].float(),
                               atol=2e-6, rtol=1e-5)
    delta = (d32 * out).sum(-1)
    dq, dk, dv = torch.zeros_like(qm), torch.zeros_like(k), torch.zeros_like(v)
    for pos, a in blocks:
        g = block_backward(qm, k[:, :, pos], v[:, :, pos], a, 8 ** -0.5, lse, d32, delta, out)
        dq += g[0]
        dk[:, :, pos] += g[1]
        dv[:, :, pos] += g[2]
    torch.testing.assert_close(dq, q64.grad[:, :, mine].float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dk, k64.grad.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dv, v64.grad.float(), atol=1e-5, rtol=1e-5)
