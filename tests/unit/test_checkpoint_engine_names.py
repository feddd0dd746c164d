"""The engine's names for its checkpoint files (DeepSpeed's method names): the optimizer-state file
``_get_optimizer_ckpt_name`` names is the one save writes and an optimizer-restoring load reads first (a
module-only load never asks), and the ``zero_to_fp32.py`` beside the tags is made executable, a failure to do
so logged and not raised (file shares that refuse chmod)."""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors import safe_open
from torch import nn

import deepshard

_CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 1}}


def _trained(seed: int) -> tuple[deepshard.DeepShardEngine, torch.optim.Adam, nn.Linear]:
    """An engine after one step, and a plain torch Adam (the reference) after the same step."""
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    reference = nn.Linear(3, 2)
    reference.load_state_dict(model.state_dict())
    engine = deepshard.initialize(model=model, config=_CFG)[0]
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.1)
    x = torch.randn(2, 3)
    engine.backward(engine(x).square().sum())
    engine.step()
    reference(x).square().sum().backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
    ref_opt.step()
    return engine, ref_opt, reference


def test_optimizer_state_file_is_the_one_the_engine_names(tmp_path: Path) -> None:
    engine, ref_opt, reference = _trained(0)
    engine.save_checkpoint(tmp_path, tag="t1")
    named = Path(engine._get_optimizer_ckpt_name(tmp_path, "t1", 0))
    assert named.parent == tmp_path / "t1" and named.is_file()
    with safe_open(str(named), "pt") as f:  # Adam's moments as torch's Adam has them after the same step
        exp_avg = f.get_tensor("optim/weight/exp_avg@0").reshape(2, 3)
    torch.testing.assert_close(exp_avg, ref_opt.state[reference.weight]["exp_avg"])

    # a module-only load never asks for the optimizer file; a load restoring optimizer state asks once
    fresh, _, _ = _trained(1)
    with mock.patch.object(fresh, "_get_optimizer_ckpt_name", wraps=fresh._get_optimizer_ckpt_name) as spy:
        fresh.load_checkpoint(tmp_path, tag="t1", load_optimizer_states=False)
        fresh.load_checkpoint(tmp_path, tag="t1", load_module_only=True)
        assert spy.call_count == 0
        fresh.load_checkpoint(tmp_path, tag="t1")
        assert spy.call_count == 1 and Path(spy.call_args.args[0]) == tmp_path


def test_save_writes_the_file_under_the_name_the_engine_gives(tmp_path: Path) -> None:
    engine, ref_opt, reference = _trained(0)
    renamed = lambda path, tag, expp_rank=0: os.path.join(str(path), str(tag), "optim_of_rank0.safetensors")
    with mock.patch.object(engine, "_get_optimizer_ckpt_name", side_effect=renamed):
        engine.save_checkpoint(tmp_path, tag="t1")
    assert (tmp_path / "t1" / "optim_of_rank0.safetensors").is_file()
    assert not (tmp_path / "t1" / "zero_rank0.safetensors").exists()
    fresh, _, _ = _trained(1)
    fresh.load_checkpoint(tmp_path, tag="t1")  # the rank's JSON records the name: the load finds it
    torch.testing.assert_close(fresh.module.weight.detach(), reference.weight.detach())


def test_recovery_script_is_executable_and_chmod_failures_are_logged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    engine, _, _ = _trained(0)
    engine.save_checkpoint(tmp_path / "a", tag="t1")
    assert os.stat(tmp_path / "a" / "zero_to_fp32.py").st_mode & stat.S_IXUSR
    caplog.set_level(logging.INFO, logger="deepshard")
    caplog.clear()
    engine._change_recovery_script_permissions(tmp_path / "missing" / "zero_to_fp32.py")
    assert any("could not make" in line and "zero_to_fp32.py" in line for line in caplog.messages), caplog.messages

    def refuse(path: object, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted", str(path))

    caplog.clear()
    monkeypatch.setattr(os, "chmod", refuse)
    assert engine.save_checkpoint(tmp_path / "b", tag="t1")  # a file share refusing chmod: saved anyway
    assert (tmp_path / "b" / "t1").is_dir() and (tmp_path / "b" / "zero_to_fp32.py").is_file()
    assert any("Operation not permitted" in line for line in caplog.messages), caplog.messages
