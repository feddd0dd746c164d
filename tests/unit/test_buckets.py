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
