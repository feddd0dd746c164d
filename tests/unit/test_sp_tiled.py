"""Tiled MLP, tiled logits loss and sequence_tiled_compute against the untiled computation: values,
input gradients and parameter gradients (with an upstream factor, as gradient accumulation applies)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from deepshard.sp.tiled import TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _grads(module: nn.Module) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    return grads


def test_tiled_mlp_equals_the_mlp() -> None:
    torch.manual_seed(0)
    mlp = MLP().double()
    x = torch.randn(2, 11, 8, dtype=torch.float64, requires_grad=True)
    (mlp(x) * 0.25).sum().backward()
    want_x, want = x.grad.clone(), _grads(mlp)
    x.grad = None
    out = TiledMLP.apply(lambda self, t: self(t), mlp, x, 3, list(mlp.parameters()))
    assert torch.allclose(out, mlp(x))
    (out * 0.25).sum().backward()
    assert torch.allclose(x.grad, want_x)
    for a, b in zip(_grads(mlp), want):
        assert torch.allclose(a, b)


def test_tiled_logits_loss_equals_the_loss_with_the_upstream_factor() -> None:
    torch.manual_seed(1)
    head = nn.Linear(8, 50, bias=False).double()
    x = torch.randn(2, 12, 8, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 50, (2, 12))

    def loss_fn(self: nn.Module, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(xs), ys.reshape(-1))

    (F.cross_entropy(head(x).reshape(-1, 50), y.reshape(-1)) / 3).backward()  # 1/3: e.g. accumulation steps
    want_x, want = x.grad.clone(), _grads(head)
    x.grad = None
    loss = TiledFusedLogitsLoss.apply(loss_fn, head, x, y, None, 4, [head.weight], "mean")
    assert torch.allclose(loss, F.cross_entropy(head(x).reshape(-1, 50), y.reshape(-1)))
    (loss / 3).backward()
    assert torch.allclose(x.grad, want_x)
    assert torch.allclose(_grads(head)[0], want[0])


def test_sequence_tiled_compute_sum_and_none() -> None:
    torch.manual_seed(2)
    mlp = MLP().double()
    x = torch.randn(1, 10, 8, dtype=torch.float64, requires_grad=True)
    mlp(x).sum().backward()
    want_x, want = x.grad.clone(), _grads(mlp)
    x.grad = None
    out = sequence_tiled_compute(lambda hidden: mlp(hidden), 10, 3, {"hidden": x}, {}, "hidden",
                                 compute_params=list(mlp.parameters()), output_reduction="sum")
    out.backward()
    assert torch.allclose(x.grad, want_x)
    for a, b in zip(_grads(mlp), want):
        assert torch.allclose(a, b)
    x.grad = None
    full = sequence_tiled_compute(lambda hidden: mlp(hidden), 10, 3, {"hidden": x}, {}, "hidden",
                                  compute_params=list(mlp.parameters()), output_reduction=None)
    assert torch.allclose(full, mlp(x))
    (full * 2).mean().backward()
    mlp.zero_grad()
    x2 = x.detach().clone().requires_grad_()
    (mlp(x2) * 2).mean().backward()
    assert torch.allclose(x.grad, x2.grad)
