"""The parts that make every ZeRO stage compute the same bits (docs/determinism.md), each against an
independent reference: the canonical tree over ranks (``comm/tree_sum.py``), the exact gradient norm
(``zero/grad_norm.py``) and torch's fused Adam given whole vectors only (``optim/whole_vectors.py``)."""
from __future__ import annotations

import math

import pytest
import torch

from deepshard.comm.tree_sum import OwnChunk, split_point, tree_sum
from deepshard.zero.grad_norm import NormScratch, decode, encode, exact_norm
from deepshard.optim.whole_vectors import WIDTH, step_whole_vectors


def _written_tree(values: list[torch.Tensor]) -> torch.Tensor:
    """Spans split after their largest power of two: 4 -> (0 + 1) + (2 + 3), 5 -> ((0+1)+(2+3)) + 4."""
    if len(values) == 1:
        return values[0].clone()
    half = 1
    while half * 2 < len(values):
        half *= 2
    return _written_tree(values[:half]) + _written_tree(values[half:])


def test_split_point() -> None:
    assert [split_point(0, n) for n in (2, 3, 4, 5, 8, 9)] == [1, 2, 2, 4, 4, 8]
    assert split_point(4, 7) == 6


@pytest.mark.parametrize("size", [2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_sum_is_the_written_tree_whoever_owns_the_chunk(size: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(size)
    values = [(torch.randn(37, generator=g) * 10 ** torch.randint(-3, 4, (37,), generator=g)).to(dtype)
              for _ in range(size)]
    wide = size > 2 and dtype != torch.float32
    expected = _written_tree([v.float() if wide else v for v in values]).to(dtype)
    for rank in range(size):
        own = OwnChunk([(0, values[rank][:20]), (20, values[rank][20:])])  # this rank's chunk in two pieces
        for writable in (True, False):
            others = {r: values[r].clone() for r in range(size) if r != rank}
            got = tree_sum(size, rank, others.__getitem__, own, writable and not wide,
                           lambda: torch.empty(37, dtype=torch.float32 if wide else dtype), lambda t: None)
            assert torch.equal(got.to(dtype), expected), (rank, writable)


def _split(t: torch.Tensor, cuts: list[int]) -> list[torch.Tensor]:
    bounds = [0] + cuts + [t.numel()]
    return [t[a:b] for a, b in zip(bounds, bounds[1:])]


def test_exact_norm_is_the_same_however_the_gradient_is_cut() -> None:
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(50_000, generator=g) * 10 ** torch.randint(-6, 3, (50_000,), generator=g).float()
    scratch = NormScratch()
    norms = {exact_norm({1: [lambda cuts=cuts: _split(grad, cuts)]}, [], torch.device("cpu"), scratch)
             for cuts in ([], [1], [7, 7, 100], [12_345, 40_000], list(range(1, 50_000, 997)))}
    assert len(norms) == 1
    reference = float(grad.double().norm())
    assert abs(norms.pop() - reference) <= 1e-9 * reference
    bf16 = grad[:1000].bfloat16()
    assert math.isclose(exact_norm({1: [lambda: [bf16]]}, [], torch.device("cpu"), scratch),
                        float(bf16.double().norm()), rel_tol=1e-9)


def test_exact_norm_edges_and_copies() -> None:
    cpu, scratch = torch.device("cpu"), NormScratch()
    assert exact_norm({1: [lambda: [torch.zeros(5)]]}, [], cpu, scratch) == 0.0
    assert exact_norm({1: [lambda: [torch.tensor([1.0, float("nan")])]]}, [], cpu, scratch) == math.inf
    assert exact_norm({1: [lambda: [torch.tensor([1.0, -float("inf")])]]}, [], cpu, scratch) == math.inf
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([12.0])
    # a part held by 2 model-parallel ranks counts once: here this rank is the only one, so a half of it
    got = exact_norm({1: [lambda: [b]], 2: [lambda: [a]]}, [], cpu, scratch, copies_max=2)
    assert math.isclose(got, math.sqrt(144 + 25 / 2), rel_tol=1e-12)
    assert math.isclose(exact_norm({1: [lambda: [a]]}, [], cpu, scratch, divisor=4), 2.5, rel_tol=1e-12)
    values = [0, 1, (1 << 90) + 12345, (1 << 149) - 1]
    assert decode(encode(values, cpu)) == values
    with pytest.raises(OverflowError):
        encode([1 << 150], cpu)


def _fused_steps(pieces: list[torch.Tensor], grads: list[list[torch.Tensor]], whole: bool,
                 cls: type = torch.optim.AdamW, amsgrad: bool = False) -> list[torch.Tensor]:
    params = [torch.nn.Parameter(p.clone()) for p in pieces]
    opt = cls(params, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.01, fused=True, amsgrad=amsgrad)
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = gr.clone()
        step_whole_vectors(opt) if whole else opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("cls, amsgrad", [(torch.optim.AdamW, False), (torch.optim.Adam, True)])
def test_fused_adam_on_whole_vectors_is_the_vector_loop_for_every_element(cls: type, amsgrad: bool) -> None:
    """The reference: torch's own fused step on each tensor zero-padded to a multiple of WIDTH (so no
    element reaches the scalar tail); any cut of the tensor must give those values."""
    g = torch.Generator().manual_seed(1)
    n = 4099
    param = torch.randn(n, generator=g) * 0.02
    grads = [torch.randn(n, generator=g) * 10 ** (-8 * torch.rand(n, generator=g)) for _ in range(6)]
    padded = -(-n // WIDTH) * WIDTH

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, torch.zeros(padded - n)])

    reference = _fused_steps([pad(param)], [[pad(gr)] for gr in grads], whole=False, cls=cls, amsgrad=amsgrad)[0][:n]
    small = list(range(13, n, 13))  # pieces of 13: every element in a scalar tail
    plain = torch.cat(_fused_steps(_split(param, small), [_split(gr, small) for gr in grads], whole=False, cls=cls,
                                   amsgrad=amsgrad))
    for cuts in ([], [1], [3, 17], [63, 64, 65, 2000], [1365, 2731], small):
        got = _fused_steps(_split(param, cuts), [_split(gr, cuts) for gr in grads], whole=True, cls=cls,
                           amsgrad=amsgrad)
        assert torch.equal(torch.cat(got), reference), cuts
    assert not torch.equal(plain, reference)  # the scalar tail does round differently: the case is real


def test_whole_vectors_keeps_state_and_step_counts() -> None:
    """Parameters at different step counts (one skipped a step), a first step creating the state, and a
    state dict that loads back."""
    g = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (5, 70, 128, 1, 200)]
    opt = torch.optim.Adam(params, lr=1e-2, fused=True)
    for step in range(5):
        for i, p in enumerate(params):
            p.grad = None if (i == 1 and step == 2) else torch.randn(p.numel(), generator=g)
        step_whole_vectors(opt)
    assert [float(opt.state[p]["step"]) for p in params] == [5.0, 4.0, 5.0, 5.0, 5.0]
    assert all(opt.state[p]["exp_avg"].shape == p.shape for p in params)
    assert len(opt.state) == len(params) and [p for group in opt.param_groups for p in group["params"]] == params
    opt.load_state_dict(opt.state_dict())
