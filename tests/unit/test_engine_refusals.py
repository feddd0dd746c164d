"""Calls the engine refuses where DeepSpeed 0.19.8 refuses them, with an error that is also the AssertionError
DeepSpeed raises there (code written against DeepSpeed's error still catches it): a loss ``engine.backward`` /
``engine.scale`` cannot use (not one element, or without grad; DeepSpeed: "loss must be a scalar tensor ..."),
and ``set_gradient_accumulation_boundary`` with ``managed_gradient_accumulation`` false (the caller's step()
is the boundary)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import deepshard
from deepshard.engine import LossError
from deepshard.engine_coalesce import GradContextMisuse


def _engine(**extra: object) -> deepshard.DeepShardEngine:
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}
    return deepshard.initialize(model=nn.Linear(3, 2), config=cfg)[0]


def test_non_scalar_and_gradless_losses_are_refused_as_deepspeed_refuses_them() -> None:
    import torch.distributed as dist

    created = not dist.is_initialized()
    engine = _engine()
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


def test_boundary_override_is_refused_when_the_caller_owns_the_boundary() -> None:
    import torch.distributed as dist

    created = not dist.is_initialized()
    engine = _engine(gradient_accumulation_steps=2, managed_gradient_accumulation=False)
    managed = _engine(gradient_accumulation_steps=2)
    try:
        with pytest.raises(AssertionError, match="set_gradient_accumulation_boundary.*managed_gradient_accumulation"):
            engine.set_gradient_accumulation_boundary(True)
        assert issubclass(GradContextMisuse, AssertionError)
        before = engine.module.weight.detach().clone()
        engine.backward(engine(torch.randn(2, 3)).sum())
        engine.step()  # every step() is a boundary: the update is applied at once
        assert engine.was_step_applied() and not torch.equal(before, engine.module.weight)
        managed.set_gradient_accumulation_boundary(True)  # managed mode keeps the override
        assert managed.is_gradient_accumulation_boundary()
    finally:
        engine.destroy()
        managed.destroy()
        if created and dist.is_initialized():
            dist.destroy_process_group()
