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


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_step_tree_continues_the_tree_over_ranks(dp: int) -> None:
    """8 atoms as dp ranks x 8/dp steps: each step's tree over ranks, continued by ``StepTree`` over the
    steps, is the written tree over the 8 atoms (``zero/canonical.py``), times the factor, for every dp."""
    from deepshard.zero.canonical import StepTree

    g = torch.Generator().manual_seed(dp)
    atoms = [torch.randn(29, generator=g) * 10 ** torch.randint(-3, 4, (29,), generator=g) for _ in range(8)]
    base = torch.full((29,), float("nan"))
    tree = StepTree(base)
    for step in range(8 // dp):
        tree.current().copy_(_written_tree(atoms[step * dp:(step + 1) * dp]))
        tree.commit()
    assert tree.pending == 8 // dp
    result = tree.finish(0.125)
    assert result is base and torch.equal(result, _written_tree(atoms) * 0.125)
    assert tree.pending == 0 and tree.nbytes() <= 3 * 29 * 4  # at most floor(log2 8) partial sums beyond base


def test_step_tree_with_a_step_count_not_a_power_of_two() -> None:
    """3 steps: the binary counter holds (s0 + s1) and s2; the rest are added newest first."""
    from deepshard.zero.canonical import StepTree

    steps = [torch.randn(11, generator=torch.Generator().manual_seed(i)) * 10 ** i for i in range(3)]
    tree = StepTree(torch.zeros(11))
    for _ in range(2):  # twice over: finish starts the tree over
        for s in steps:
            tree.current().copy_(s)
            tree.commit()
        assert torch.equal(tree.finish(0.5), ((steps[0] + steps[1]) + steps[2]) * 0.5)


def test_atom_sampler_gives_every_split_the_same_micro_batches() -> None:
    """Rank r's micro-step m of a global batch is micro-batch m x dp + r of the same shuffled order, for
    every dp x accumulation split (and a partial last batch is completed from the epoch's start)."""
    from deepshard.data import AtomSampler

    data = list(range(37))
    micro, atoms = 2, 8

    def atoms_of(dp: int) -> list[list[int]]:
        per_rank = [list(AtomSampler(data, micro, r, dp, atoms // dp, seed=5)) for r in range(dp)]
        out = []
        for batch in range(len(per_rank[0]) // (micro * atoms // dp)):
            for m in range(atoms // dp):
                for r in range(dp):
                    at = (batch * atoms // dp + m) * micro
                    out.append(per_rank[r][at:at + micro])
        return out

    reference = atoms_of(1)
    assert all(atoms_of(dp) == reference for dp in (2, 4, 8))
    flat = [i for a in reference for i in a]
    assert len(flat) == 48 and sorted(set(flat)) == data  # 3 global batches of 16 cover the epoch


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_contiguous_split_sums_the_same_tree(dp: int) -> None:
    """The contiguous split (``zero/local_steps.py``): each of dp ranks sums its 8/dp consecutive atoms in
    its own tree (micro-steps written into ``.grad``, autograd-style, the boundary closed bucket by bucket),
    then the ranks' sums go through the written tree over ranks: the written tree over the 8 atoms."""
    from deepshard.zero.local_steps import LocalSteps

    g = torch.Generator().manual_seed(10 + dp)
    atoms = [torch.randn(13, generator=g) * 10 ** torch.randint(-3, 4, (13,), generator=g) for _ in range(8)]
    gas = 8 // dp
    sums = []
    for rank in range(dp):
        params = [torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(8))]
        base = torch.zeros(13)
        local = LocalSteps(base, [(params[0], 0), (params[1], 5)])
        for _ in range(2):  # twice over: finish starts the tree over
            local.finish()
            base.zero_()  # the reducer's zero_() after the step
            for m in range(gas):
                local.begin()
                atom = atoms[rank * gas + m]
                params[0].grad.add_(atom[:5])  # what autograd does: add into the .grad it finds
                params[1].grad.add_(atom[5:])
                if m < gas - 1:
                    local.commit()
            local.close(0, 5)
            local.close(5, 13)
        assert params[0].grad is not None and params[0].grad.data_ptr() != base.data_ptr() or gas == 1
        sums.append(base.clone())
        assert local.nbytes() <= 3 * 13 * 4
    assert torch.equal(_written_tree(sums), _written_tree(atoms))


def test_predivided_micro_steps_enter_the_tree_divided() -> None:
    """``gradient_predivide_factor``: every micro-step is divided before it joins, as the interleaved split
    divides every atom before its reduction."""
    from deepshard.zero.local_steps import LocalSteps

    atoms = [torch.randn(7, generator=torch.Generator().manual_seed(i)) * 10 ** i for i in range(4)]
    p = torch.nn.Parameter(torch.zeros(7))
    base = torch.zeros(7)
    local = LocalSteps(base, [(p, 0)], predivide=3.0)
    local.finish()
    for m, atom in enumerate(atoms):
        local.begin()
        p.grad.add_(atom)
        if m < 3:
            local.commit()
    local.close()
    assert torch.equal(base, _written_tree([a / 3.0 for a in atoms]))


def test_contiguous_split_choice_and_atom_index() -> None:
    """Stages 0 and 1 take the contiguous split with fp32 gradients and a power-of-two accumulation; every
    (rank, step) of either split names a different atom of the global batch."""
    from deepshard.zero.canonical import atom_index, contiguous_split

    f32, bf16 = torch.float32, torch.bfloat16
    assert contiguous_split(0, 2, f32, None) and contiguous_split(1, 8, f32, f32)
    assert not contiguous_split(2, 2, f32, None) and not contiguous_split(3, 4, f32, None)
    assert not contiguous_split(1, 3, f32, None) and not contiguous_split(1, 1, f32, None)
    assert not contiguous_split(1, 4, bf16, None) and not contiguous_split(0, 4, f32, bf16)
    for contiguous in (False, True):
        names = sorted(atom_index(r, m, 4, 2, contiguous) for r in range(4) for m in range(2))
        assert names == list(range(8))
    assert atom_index(1, 0, 4, 2, True) == 2 and atom_index(1, 0, 4, 2, False) == 1
    with pytest.raises(ValueError, match="out of range"):
        atom_index(4, 0, 4, 2, True)


def test_contiguous_atom_sampler_follows_atom_index() -> None:
    """The engine's loader in the contiguous split: rank r's micro-step m is micro-batch r x gas + m of the
    global batch the interleaved split trains (the same samples, another assignment)."""
    from deepshard.data import AtomSampler
    from deepshard.zero.canonical import atom_index

    data, micro, dp, gas = list(range(32)), 2, 2, 4
    whole = list(AtomSampler(data, micro, 0, 1, dp * gas, seed=3))  # dp=1: atom a is samples [2a, 2a + 2)
    for r in range(dp):
        mine = list(AtomSampler(data, micro, r, dp, gas, seed=3, contiguous=True))
        for batch in range(2):
            for m in range(gas):
                a = batch * dp * gas + atom_index(r, m, dp, gas, True)
                at = (batch * gas + m) * micro
                assert mine[at:at + micro] == whole[a * micro:(a + 1) * micro]
