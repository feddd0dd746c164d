"""The loss ``engine.backward`` and ``engine.scale`` accept: one element with grad. Anything else is refused
with an error that is a ValueError and also the AssertionError DeepSpeed 0.19.8 raises there ("loss must be a
scalar tensor ..."), so code written against DeepSpeed's error still catches it; the message names the call."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import deepshard
from deepshard.engine import LossError


def test_non_scalar_and_gradless_losses_are_refused_as_deepspeed_refuses_them() -> None:
    import torch.distributed as dist

    created = not dist.is_initialized()
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine = deepshard.initialize(model=nn.Linear(3, 2), config=cfg)[0]
    try:
        out = engine(torch.randn(2, 3))
        for call in ("scale", "backward"):
            refused = rf"engine\.{call} expects the loss as a scalar tensor, got \(2, 2\)"
            with pytest.raises(AssertionError, match=refused):
                getattr(engine, call)(out)
            with pytest.raises(ValueError, match="does not require grad"):
                getattr(engine, call)(torch.tensor(1.0))
        assert issubclass(LossError, ValueError) and issubclass(LossError, AssertionError)
        engine.backward(out.sum())  # a scalar with grad still trains
        engine.step()
    finally:
        engine.destroy()
        if created and dist.is_initialized():
            dist.destroy_process_group()
