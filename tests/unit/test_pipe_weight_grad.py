"""The operator-level split backward (weight_grad.py), with no process group: the input pass plus the
deferred weight pass give exactly the gradients of one ordinary backward, and the input pass really
leaves the linear weights' gradients for later."""
from __future__ import annotations

import torch
from torch import nn

from deepshard.pipe.weight_grad import DeferWeightGrads, WeightGradStore


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 5, bias=False), nn.Linear(5, 3))


def test_split_backward_gives_the_plain_gradients() -> None:
    plain, split = _model(), _model()
    x = torch.randn(4, 7, 6)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    plain(x1).square().sum().backward()
    store = WeightGradStore()
    with DeferWeightGrads(store):
        out = split(x2)
    out.square().sum().backward()  # the input pass
    assert split[0].weight.grad is None and split[4].bias.grad is None  # deferred
    assert split[1].weight.grad is not None  # a norm's gradient comes at once
    torch.testing.assert_close(x2.grad, x1.grad)
    assert len(store.pending) == 3
    store.run()  # the weight pass
    assert not store.pending
    for a, b in zip(plain.parameters(), split.parameters()):
        torch.testing.assert_close(b.grad, a.grad)
    # a second micro-batch accumulates
    with DeferWeightGrads(store):
        out = split(x2)
    out.square().sum().backward()
    store.run()
    torch.testing.assert_close(split[0].weight.grad, 2 * plain[0].weight.grad)


def test_frozen_weights_and_no_grad_are_left_alone() -> None:
    model = _model()
    model[0].weight.requires_grad_(False)
    store = WeightGradStore()
    with DeferWeightGrads(store), torch.no_grad():
        model(torch.randn(2, 6))
    with DeferWeightGrads(store):
        model(torch.randn(2, 6)).sum().backward()
    assert len(store.pending) == 2 and model[0].weight.grad is None
