"""Bucket planning and the bucketed all-reduce on a world of one (no process group needed)."""
from __future__ import annotations

import pytest
import torch

from deepshard.comm import CommGroup
from deepshard.zero.buckets import BucketedAllReduce, plan_buckets


def _params(*sizes: int, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]


def test_plan_respects_size_and_order() -> None:
    ps = _params(3, 4, 5, 20, 1)
    plans = plan_buckets(ps, 8)
    assert [[p.numel() for p in b] for b in plans] == [[3, 4], [5], [20], [1]]


def test_plan_never_mixes_dtypes() -> None:
    ps = _params(2, 2) + _params(2, dtype=torch.bfloat16) + _params(2)
    plans = plan_buckets(ps, 100)
    assert [[p.dtype for p in b] for b in plans] == [[torch.float32] * 2, [torch.bfloat16], [torch.float32]]


def test_plan_rejects_nonpositive_size() -> None:
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        plan_buckets(_params(1), 0)


def test_grads_are_views_and_accumulate_in_place() -> None:
    lin = torch.nn.Linear(3, 2)
    reducer = BucketedAllReduce(list(lin.parameters()), CommGroup(), bucket_elements=4)
    x = torch.randn(5, 3)
    for _ in range(2):
        reducer.begin_backward(reduce=False)
        lin(x).sum().backward()
        reducer.end_backward()
    expected_w = 2 * torch.ones(5, 2).T @ x
    assert torch.allclose(lin.weight.grad, expected_w)
    views = reducer.grads()
    assert any(v.data_ptr() == lin.weight.grad.data_ptr() for v in views)
    lin.zero_grad(set_to_none=True)  # a user dropping the views must not break the next backward
    reducer.begin_backward(reduce=False)
    lin(x).sum().backward()
    assert torch.allclose(lin.weight.grad, torch.ones(5, 2).T @ x)
    assert reducer.buffer_bytes() == sum(p.numel() * 4 for p in lin.parameters())


def test_zero_sets_grads_to_none_and_the_next_backward_overwrites_the_views() -> None:
    lin, unused = torch.nn.Linear(3, 2), torch.nn.Parameter(torch.ones(4))
    params = list(lin.parameters()) + [unused]
    reducer = BucketedAllReduce(params, CommGroup(), bucket_elements=4)
    x = torch.randn(5, 3)
    unused.grad.fill_(7.0)  # a stale value the next backward must not keep
    reducer.begin_backward(reduce=False)
    lin(x).sum().backward()
    reducer.end_backward()
    reducer.zero_()
    assert all(p.grad is None for p in params)
    reducer.begin_backward(reduce=True)
    lin(x).sum().backward()
    reducer.end_backward()
    assert torch.allclose(lin.weight.grad, torch.ones(5, 2).T @ x)  # one backward's worth, not two
    assert torch.equal(unused.grad, torch.zeros(4))  # no gradient reached it: its view was cleared
    views = {v.data_ptr() for v in reducer.grads()}
    assert all(p.grad.data_ptr() in views for p in params)


def test_grads_read_after_zero_without_a_backward_are_zeros() -> None:
    lin = torch.nn.Linear(3, 2)
    reducer = BucketedAllReduce(list(lin.parameters()), CommGroup(), bucket_elements=100, overlap=False)
    reducer.begin_backward(reduce=False)
    lin(torch.randn(2, 3)).sum().backward()
    reducer.end_backward()
    reducer.zero_()
    assert all(float(g.abs().sum()) == 0.0 for g in reducer.grads())
    assert all(p.grad is not None for p in lin.parameters())


def test_stage0_overlaps_unless_the_config_says_otherwise() -> None:
    from deepshard.config.zero import ZeroConfig
    from deepshard.zero.stage0 import overlap_for

    assert overlap_for(ZeroConfig(stage=0))
    assert overlap_for(ZeroConfig(stage=0, overlap_comm=True))
    assert not overlap_for(ZeroConfig(stage=0, overlap_comm=False))


def test_stage0_adapts_its_schedule_only_when_the_config_leaves_it_unset() -> None:
    from deepshard.config.zero import ZeroConfig
    from deepshard.zero.stage0 import adaptive_overlap

    assert adaptive_overlap(ZeroConfig(stage=0))
    assert not adaptive_overlap(ZeroConfig(stage=0, overlap_comm=True))
    assert not adaptive_overlap(ZeroConfig(stage=0, overlap_comm=False))


@pytest.mark.parametrize("overlapped_ms, after_ms, keeps", [(10.0, 20.0, True), (30.0, 20.0, False)])
def test_adaptive_overlap_times_both_schedules_and_keeps_the_faster(overlapped_ms: float, after_ms: float,
                                                                    keeps: bool) -> None:
    from deepshard.zero.schedule import AdaptiveOverlap

    now = [0.0]
    chooser = AdaptiveOverlap(probes=2, settle=1, recheck_every=3, clock=lambda: now[0])

    def backward(cost_of: dict[bool, float]) -> bool:
        mode = chooser.next_overlap()
        now[0] += cost_of[mode] / 1e3
        chooser.finished()
        return mode

    costs = {True: overlapped_ms, False: after_ms}
    # settle (overlapped, untimed: a first step's allocations would skew it), then both schedules in turn
    assert [backward({True: 500.0, False: 500.0})] + [backward(costs) for _ in range(4)] == \
        [True, True, False, True, False]
    assert chooser.choice is keeps and chooser.decisions == 1
    assert [backward(costs) for _ in range(3)] == [keeps] * 3  # kept for recheck_every backwards
    # then probed again (no settling): the load changed and the other schedule is faster now
    flipped = {True: after_ms, False: overlapped_ms}
    assert [backward(flipped) for _ in range(4)] == [True, False, True, False]
    assert chooser.choice is (not keeps) and chooser.decisions == 2
    with pytest.raises(ValueError, match="probes and recheck_every must be >= 1"):
        AdaptiveOverlap(probes=0)


def test_adaptive_overlap_keeps_what_the_ranks_agree_on_not_its_own_timing() -> None:
    """Every rank must keep the same schedule: the decision is taken on the medians combined over the
    ranks (``agree``), here with another rank whose overlapped backwards were far slower."""
    from deepshard.zero.schedule import AdaptiveOverlap

    now = [0.0]
    seen: list[tuple[float, float]] = []

    def agree(overlapped: float, after: float) -> tuple[float, float]:
        seen.append((overlapped, after))
        return overlapped + 0.050, after + 0.010  # the other rank: 50 ms overlapped, 10 ms after backward

    chooser = AdaptiveOverlap(probes=2, settle=0, clock=lambda: now[0], agree=agree)
    for _ in range(4):
        mode = chooser.next_overlap()
        now[0] += (0.010 if mode else 0.020)  # this rank alone would keep overlapping
        chooser.finished()
    assert seen == [(pytest.approx(0.010), pytest.approx(0.020))]
    assert chooser.choice is False and chooser.next_overlap() is False


class _Done:
    def wait(self) -> None:
        return None


class _TwoIdenticalRanks:
    """A world of two whose ranks hold the same gradients: the all-reduce doubles the buffer."""

    size = 2

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> _Done:
        tensor.mul_(2)
        return _Done()


@pytest.mark.parametrize("overlap", [True, False])
def test_the_average_folded_into_the_copy_gives_the_mean_gradient(overlap: bool) -> None:
    torch.manual_seed(0)
    lin, unused = torch.nn.Linear(3, 4), torch.nn.Parameter(torch.ones(2))
    params = list(lin.parameters()) + [unused]
    reducer = BucketedAllReduce(params, _TwoIdenticalRanks(), bucket_elements=6, overlap=overlap)
    x = torch.randn(5, 3)
    reference = torch.autograd.grad(lin(x).square().sum(), [lin.weight, lin.bias])
    for _ in range(2):  # the second round starts from zero_(): every gradient arrives fresh and is folded
        reducer.zero_()
        reducer.begin_backward(reduce=True)
        assert reducer._fold == 0.5
        lin(x).square().sum().backward()
        reducer.end_backward()
        torch.testing.assert_close(lin.weight.grad, reference[0], rtol=0, atol=0)
        torch.testing.assert_close(lin.bias.grad, reference[1], rtol=0, atol=0)
        assert torch.equal(unused.grad, torch.zeros(2))
        assert all(p.grad.data_ptr() in {v.data_ptr() for v in reducer.grads()} for p in params)


def test_a_gradient_arriving_twice_in_one_folding_backward_is_summed_then_averaged() -> None:
    """A weight used in two separately differentiated pieces (reentrant checkpointing) gets two
    accumulations in one backward: both must land in its view, scaled once."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3)
    reducer = BucketedAllReduce(list(lin.parameters()), _TwoIdenticalRanks(), bucket_elements=100, overlap=False)
    x1, x2 = torch.randn(4, 3), torch.randn(4, 3)
    expected = torch.autograd.grad(lin(x1).sum() + lin(x2).pow(2).sum(), lin.weight)[0]
    reducer.zero_()
    reducer.begin_backward(reduce=True)
    lin(x1).sum().backward()
    lin(x2).pow(2).sum().backward()
    reducer.end_backward()
    torch.testing.assert_close(lin.weight.grad, expected)


def test_accumulated_micro_steps_are_averaged_after_the_reduction() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    reducer = BucketedAllReduce(list(lin.parameters()), _TwoIdenticalRanks(), bucket_elements=100)
    xs = [torch.randn(4, 3) for _ in range(2)]
    expected = torch.autograd.grad(sum(lin(x).sum() for x in xs), lin.weight)[0]
    reducer.zero_()
    for i, x in enumerate(xs):
        reducer.begin_backward(reduce=i == len(xs) - 1)
        assert reducer._fold == 0.0  # the last micro-step adds into what the first wrote: not folded
        lin(x).sum().backward()
        reducer.end_backward()
    torch.testing.assert_close(lin.weight.grad, expected)
