"""torch's fused CPU Adam where deepshard put the optimizer's states on the host."""
from __future__ import annotations

import pytest
import torch

from deepshard.optim.kernels import fuse_host_adam
from deepshard.optim.lion import Lion


def _steps(opt: torch.optim.Optimizer, w: torch.nn.Parameter, n: int = 4) -> torch.Tensor:
    for _ in range(n):
        opt.zero_grad()
        (w ** 3).sum().backward()
        opt.step()
    return w.detach().clone()


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_a_default_adam_is_switched_and_matches_torchs_fused_kernel(cls: type[torch.optim.Optimizer]) -> None:
    torch.manual_seed(0)
    start = torch.randn(257)
    w, ref_w, loop_w = (torch.nn.Parameter(start.clone()) for _ in range(3))
    opt = cls([w], lr=0.05, weight_decay=0.1)
    assert fuse_host_adam(opt, "test") and opt.param_groups[0]["fused"] is True
    got = _steps(opt, w)
    assert torch.equal(got, _steps(cls([ref_w], lr=0.05, weight_decay=0.1, fused=True), ref_w))
    loop = _steps(cls([loop_w], lr=0.05, weight_decay=0.1), loop_w)
    assert not torch.equal(got, start) and torch.allclose(got, loop, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kwargs", [{"foreach": False}, {"foreach": True}, {"fused": False}])
def test_a_kernel_the_user_chose_is_kept(kwargs: dict) -> None:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], **kwargs)
    assert not fuse_host_adam(opt, "test")
    assert opt.param_groups[0]["fused"] is kwargs.get("fused") and opt.param_groups[0]["foreach"] is kwargs.get("foreach")


def test_other_optimizers_and_adam_subclasses_with_their_own_step_are_left_alone() -> None:
    class MyAdam(torch.optim.Adam):
        def step(self, closure=None):  # type: ignore[no-untyped-def]
            return super().step(closure)

    for opt in (Lion([torch.nn.Parameter(torch.ones(3))]), torch.optim.SGD([torch.nn.Parameter(torch.ones(3))]),
                MyAdam([torch.nn.Parameter(torch.ones(3))])):
        assert not fuse_host_adam(opt, "test")
        assert all(g.get("fused") in (None, False) for g in opt.param_groups)
