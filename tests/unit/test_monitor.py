"""Monitors: CSV layout and values, rank gating, TensorBoard and W&B wiring and missing-package errors."""
from __future__ import annotations

import csv
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.monitor import (
    LR,
    TRAIN_LOSS,
    CSVMonitor,
    Monitor,
    MonitorMaster,
    TensorBoardMonitor,
    WandbMonitor,
)


def read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def cfg(**kw: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(**kw)


def test_csv_monitor_layout_and_values(tmp_path: Path) -> None:
    mon = CSVMonitor(output_path=str(tmp_path), job_name="bert")
    assert isinstance(mon, Monitor)
    mon.write_events([(TRAIN_LOSS, 2.5, 32), (LR, 1e-4, 32), ("eval acc", torch.tensor(0.75), 32)])
    mon.write_events([(TRAIN_LOSS, 0.1 + 0.2, 64), (TRAIN_LOSS, 1.0, 96)])
    job = tmp_path / "bert"
    assert sorted(p.name for p in job.iterdir()) == [
        "Train_Samples_lr.csv", "Train_Samples_train_loss.csv", "eval_acc.csv"]
    loss = read_csv(job / "Train_Samples_train_loss.csv")
    assert loss == [["step", "train_loss"], ["32", "2.5"], ["64", repr(0.1 + 0.2)], ["96", "1.0"]]
    assert float(loss[2][1]) == 0.1 + 0.2  # values round-trip exactly
    assert read_csv(job / "Train_Samples_lr.csv") == [["step", "lr"], ["32", "0.0001"]]
    assert read_csv(job / "eval_acc.csv") == [["step", "eval acc"], ["32", "0.75"]]
    mon.close()

    # A resumed run appends to the same tables without a second header.
    CSVMonitor(output_path=str(tmp_path), job_name="bert").write_events([(LR, 5e-5, 128)])
    assert read_csv(job / "Train_Samples_lr.csv") == [["step", "lr"], ["32", "0.0001"], ["128", "5e-05"]]


def test_csv_default_output_path_is_cwd_job_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    master = MonitorMaster(None, cfg(enabled=True, output_path="", job_name="DeepSpeedJobName"), None, 0)
    master.write_events([(TRAIN_LOSS, 1.25, 8)])
    assert read_csv(tmp_path / "DeepSpeedJobName" / "Train_Samples_train_loss.csv") == [
        ["step", "train_loss"], ["8", "1.25"]]


def test_monitor_master_rank0_writes_rank1_does_not(tmp_path: Path) -> None:
    section = {"enabled": True, "output_path": str(tmp_path / "r1"), "job_name": "j"}
    off = MonitorMaster(cfg(enabled=False), section, cfg(enabled=False), rank=1)
    assert off.enabled is False
    off.write_events([(TRAIN_LOSS, 1.0, 1)])
    off.close()
    assert not (tmp_path / "r1").exists()

    section["output_path"] = str(tmp_path / "r0")
    on = MonitorMaster(cfg(enabled=False), section, None, rank=0)
    assert on.enabled is True
    on.write_events([(TRAIN_LOSS, 3.0, 4)])
    assert read_csv(tmp_path / "r0" / "j" / "Train_Samples_train_loss.csv")[1] == ["4", "3.0"]
    on.close()
    on.write_events([(TRAIN_LOSS, 3.0, 5)])  # closed: ignored
    assert len(read_csv(tmp_path / "r0" / "j" / "Train_Samples_train_loss.csv")) == 2

    none = MonitorMaster(None, None, None, rank=0)
    assert none.enabled is False


def test_bad_events_are_refused(tmp_path: Path) -> None:
    master = MonitorMaster(None, cfg(enabled=True, output_path=str(tmp_path), job_name="j"), None, 0)
    with pytest.raises(ValueError, match="must be a .name, value, step. triple"):
        master.write_events([("loss", 1.0)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="value must be a number"):
        master.write_events([("loss", "high", 1)])  # type: ignore[list-item]
    for bad in ("", "../up", "/abs"):
        with pytest.raises(ValueError, match="job_name"):
            CSVMonitor(str(tmp_path), bad)
    assert CSVMonitor(str(tmp_path), "exp/run1").log_dir == tmp_path / "exp" / "run1"


def test_tensorboard_missing_package_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    section = cfg(enabled=True, output_path=str(tmp_path), job_name="tb")
    with pytest.raises(ImportError, match=r"pip install tensorboard.*tensorboard.enabled to false"):
        MonitorMaster(section, None, None, rank=0)
    MonitorMaster(section, None, None, rank=1)  # other ranks never import it


def test_tensorboard_writes_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="optional `tensorboard` package not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    mon = TensorBoardMonitor(str(tmp_path), "tb")
    mon.write_events([(TRAIN_LOSS, 2.0, 16), (TRAIN_LOSS, 1.5, 32)])
    mon.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars(TRAIN_LOSS)] == [(16, 2.0), (32, 1.5)]


class FakeRun:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, float], int]] = []
        self.finished = False

    def log(self, data: dict[str, float], step: int) -> None:
        self.logged.append((data, step))

    def finish(self) -> None:
        self.finished = True


def fake_wandb(monkeypatch: pytest.MonkeyPatch, run: FakeRun | None = None) -> types.ModuleType:
    module = types.ModuleType("wandb")
    module.run = run  # type: ignore[attr-defined]
    module.inits = []  # type: ignore[attr-defined]

    def init(**kw: Any) -> FakeRun:
        module.inits.append(kw)  # type: ignore[attr-defined]
        return FakeRun()

    module.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_wandb_monitor_logs_events(monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = fake_wandb(monkeypatch)
    master = MonitorMaster(None, None, cfg(enabled=True, group="g", team="t", project="p"), rank=0)
    assert wandb.inits == [{"project": "p", "group": "g", "entity": "t"}]
    master.write_events([(TRAIN_LOSS, 0.5, 10), (LR, 0.01, 10)])
    run = master.monitors[0]._run
    assert run.logged == [({TRAIN_LOSS: 0.5}, 10), ({LR: 0.01}, 10)]
    master.close()
    assert run.finished

    existing = FakeRun()
    fake_wandb(monkeypatch, existing)
    mon = WandbMonitor(project="p")
    mon.write_events([(LR, 0.02, 20)])
    mon.close()
    assert existing.logged == [({LR: 0.02}, 20)] and not existing.finished  # the user's run stays open


def test_wandb_missing_package_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install wandb.*wandb.enabled to false"):
        MonitorMaster(None, None, {"enabled": True}, rank=0)
