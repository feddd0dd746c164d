"""``engine.optimizer`` at ZeRO stages 1-3 is the engine's ZeRO optimizer (DeepSpeed's classes), the torch
optimizer its ``.optimizer``; at stage 0 the torch optimizer itself. Its ``step()`` is checked against plain
PyTorch (AdamW with ``clip_grad_norm_``) on a world of one, in this process."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import deepshard
from deepshard.compat.ds_optimizers import (BF16_Optimizer, DeepSpeedOptimizer, DeepSpeedZeroOptimizer,
                                            DeepSpeedZeroOptimizer_Stage3, ZeROOptimizer)

CLIP = 0.5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _engine(stage: int) -> tuple[deepshard.DeepShardEngine, object, torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": CLIP, "zero_optimization": {"stage": stage}}
    engine, returned, _, _ = deepshard.initialize(model=model, optimizer=opt, config=cfg)
    return engine, returned, opt


@pytest.fixture(scope="module", autouse=True)
def _world() -> object:
    import torch.distributed as dist

    created = not dist.is_initialized()
    yield
    if created and dist.is_initialized():
        dist.destroy_process_group()


def test_stage_0_hands_out_the_torch_optimizer() -> None:
    engine, returned, opt = _engine(0)
    try:
        assert returned is opt and engine.optimizer is opt and not isinstance(opt, DeepSpeedOptimizer)
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_optimizer_surface_and_step_match_torch(stage: int) -> None:
    engine, zopt, opt = _engine(stage)
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    try:
        cls = DeepSpeedZeroOptimizer_Stage3 if stage == 3 else DeepSpeedZeroOptimizer
        assert zopt is engine.optimizer and type(zopt) is cls and isinstance(zopt, ZeROOptimizer)
        assert not isinstance(zopt, BF16_Optimizer) and zopt.optimizer is opt
        assert zopt.param_groups is opt.param_groups and zopt.state is opt.state and zopt.defaults is opt.defaults
        assert not zopt.needs_scaler() and zopt.loss_scale == zopt.cur_scale == 1.0 and not zopt.overflow
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
        for _ in range(2):  # the ZeRO optimizer's step, then zero_grad, as a torch loop does
            engine.backward(engine(x).pow(2).mean())
            zopt.step()
            zopt.zero_grad()
            ref_opt.zero_grad()
            ref(x).pow(2).mean().backward()
            norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
            ref_opt.step()
            assert zopt._global_grad_norm == pytest.approx(norm, rel=1e-5)
            assert engine.get_global_grad_norm() == zopt._global_grad_norm
        assert engine.global_steps == 0 and engine.get_lr() == [0.05]  # counters and schedule are engine.step()'s
        got = {n: engine.strategy.full_fp32_param(p) for n, p in engine.module.named_parameters()}
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got[n].reshape(p.shape), p.detach(), rtol=1e-5, atol=1e-6)
        keys = zopt.fp32_partitioned_groups_flat if stage == 3 else zopt.single_partition_of_fp32_groups
        assert keys and all(k in opt.state and int(opt.state[k]["step"]) == 2 for k in keys)
        assert zopt.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
        norms = zopt._get_norm_groups()  # no gradients left after zero_grad
        assert float(torch.linalg.vector_norm(torch.stack(norms))) == 0.0
        with pytest.raises(RuntimeError, match="Call engine.step"):
            opt.step()  # the torch optimizer stays guarded
        with pytest.raises(AttributeError, match=r"engine\.optimizer\.optimizer \(AdamW\)"):
            zopt.amsgrad  # noqa: B018 - no fall-through to the torch optimizer, as DeepSpeed
        bad = x.clone()
        bad[0, 0] = float("nan")
        engine.backward(engine(bad).pow(2).mean())
        before = {n: engine.strategy.full_fp32_param(p) for n, p in engine.module.named_parameters()}
        zopt.step()  # not finite: skipped, gradients cleared
        assert zopt.overflow and not math.isfinite(zopt._global_grad_norm)
        after = {n: engine.strategy.full_fp32_param(p) for n, p in engine.module.named_parameters()}
        assert all(torch.equal(before[n], after[n]) for n in before)
        assert float(zopt._get_norm_groups()[0]) == 0.0 and engine.skipped_steps == 0
        if stage == 3:
            assert zopt.parameter_offload.module is engine.module and zopt.parameter_offload.forward_hooks
    finally:
        engine.destroy()
    if stage == 3:
        assert not hasattr(zopt, "parameter_offload")  # the hooks went with the engine


def test_the_zero_optimizer_classes_are_not_built_by_hand() -> None:
    for cls in (ZeROOptimizer, DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer):
        with pytest.raises(NotImplementedError, match="deepshard.initialize"):
            cls()


@pytest.mark.parametrize("fp16, dynamic", [({"enabled": True, "initial_scale_power": 8}, True),
                                           ({"enabled": True, "loss_scale": 128}, False)])
def test_needs_scaler_is_deepspeeds_answer(fp16: dict, dynamic: bool) -> None:
    model = _model()
    cfg = {"train_micro_batch_size_per_gpu": 2, "fp16": fp16, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    engine, zopt, _, _ = deepshard.initialize(model=model, config=cfg)
    try:
        assert zopt.needs_scaler() is dynamic and zopt.dynamic_loss_scale is dynamic  # DeepSpeed: dynamic scaling only
        assert zopt.loss_scale == engine.loss_scale == (256.0 if dynamic else 128.0)
        zopt.cur_scale = 64.0
        assert engine.loss_scale == 64.0
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [2, 3])
def test_torch_optimizer_state_dict_comes_back_from_a_checkpoint_as_saved(stage: int, tmp_path: object) -> None:
    """``engine.optimizer.optimizer.state_dict()`` after ``load_checkpoint`` equals the one saved, entry by entry
    in the same order (DeepSpeed's checkpoint tests zip the two)."""
    engine, zopt, _ = _engine(stage)
    fresh, fresh_opt, _ = _engine(stage)
    try:
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(2))
        for _ in range(2):
            engine.backward(engine(x).pow(2).mean())
            engine.step()
        saved = zopt.optimizer.state_dict()
        engine.save_checkpoint(str(tmp_path), tag="t")
        fresh.load_checkpoint(str(tmp_path), tag="t")
        loaded = fresh_opt.optimizer.state_dict()
        assert saved["param_groups"] == loaded["param_groups"]
        assert list(saved["state"]) == list(loaded["state"]) and saved["state"]
        for (k0, s0), (k1, s1) in zip(saved["state"].items(), loaded["state"].items()):
            assert k0 == k1 and s0.keys() == s1.keys()
            assert all(torch.equal(s0[k], s1[k]) for k in s0), k0
    finally:
        engine.destroy()
        fresh.destroy()


@pytest.mark.parametrize("stage, groups", [(1, 1), (2, 2)])
def test_bit16_groups_flat_is_the_buffer_the_parameters_view(stage: int, groups: int,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``engine.optimizer.bit16_groups_flat`` (DeepSpeed's ZeRO-1/2 flat buffers): deepshard's one flat buffer,
    which every trainable parameter views, before and after a step (refused with several param groups, which
    share that one buffer); flattening it is logged with DeepSpeed's
    words ("Flattening param group ... (sufficient memory)")."""
    from deepshard.utils import logging as ds_logging

    lines: list[str] = []
    monkeypatch.setattr(ds_logging.logger, "info", lambda msg, *a, **k: lines.append(str(msg)))
    model = _model()
    split = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.01}]
    opt = torch.optim.AdamW(split if groups == 2 else model.parameters(), lr=0.05)
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    engine, zopt, _, _ = deepshard.initialize(model=model, optimizer=opt, config=cfg)
    which = "param group 0 on cpu" if groups == 1 else "param groups 0-1 on cpu"
    assert [m for m in lines if m.startswith(f"Flattening {which}") and m.endswith("(sufficient memory)")], lines
    try:
        if groups > 1:  # one buffer for all groups: no per-group list to pair with param_groups
            with pytest.raises(AttributeError, match="one buffer for all 2 param groups"):
                zopt.bit16_groups_flat
            return
        params = list(engine.module.parameters())
        (flat,) = zopt.bit16_groups_flat
        assert flat.device == engine.device and flat.dtype == params[0].dtype and flat.grad_fn is None
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(3))
        for step in range(2):
            before = [p.detach().clone() for p in params]
            with torch.no_grad():
                flat.add_(1.0)  # written through the buffer: every parameter moves
            for p, b in zip(params, before):
                assert torch.equal(p.detach(), b + 1.0)
            with torch.no_grad():
                flat.copy_(torch.arange(flat.numel(), dtype=flat.dtype) / flat.numel())
            seen = torch.cat([p.detach().reshape(-1) for p in params])
            assert seen.unique().numel() == seen.numel() == sum(p.numel() for p in params)  # no element shared
            if step == 0:  # the step publishes its update into the same buffer
                engine.backward(engine(x).pow(2).mean())
                engine.step()
                assert zopt.bit16_groups_flat[0] is flat
    finally:
        engine.destroy()
    with pytest.raises(AttributeError, match="destroyed"):
        zopt.bit16_groups_flat
