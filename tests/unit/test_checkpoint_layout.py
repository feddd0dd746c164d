"""Checkpoint format v2 with no process group: tensor-parallel parts reassembled into the global tensor,
cut again for another split, replicated copies read once, other stages' files not read; and the grid
keys read in one place (grid.dims_from_config)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepshard.checkpoint import io as ckpt_io
from deepshard.checkpoint.fragments import rank_files, save_rank_fragments
from deepshard.checkpoint.reader import load_full_state
from deepshard.shard_state import FragmentRecord
from deepshard.config import ConfigError
from deepshard.grid import dims_from_config
from deepshard.topology import ParallelDims
from deepshard.placement import mark_split


def _write(directory: Path, rank: int, tensors: dict[str, torch.Tensor], splits: dict[str, list[int]],
           exp_avg: bool = True) -> None:
    records = [FragmentRecord(name, 0, t.numel(), t.reshape(-1).float(),
                              {"exp_avg": t.reshape(-1) * 10, "step": torch.tensor(3.0)} if exp_avg else {})
               for name, t in tensors.items()]
    save_rank_fragments(directory, rank, records, {n: tuple(t.shape) for n, t in tensors.items()}, None, {}, None,
                        {"zero_stage": 1}, splits=splits)


def test_tp_parts_join_into_the_global_tensor_and_split_again(tmp_path: Path) -> None:
    weight = torch.arange(24.0).view(4, 6)
    bias = torch.arange(4.0)
    for index, (w, b) in enumerate(zip(weight.chunk(2, dim=1), bias.chunk(2))):  # row- and column-style splits
        _write(tmp_path, index, {"w": w.contiguous(), "b": b.contiguous(), "norm": torch.ones(3)},
               {"w": [1, index, 2], "b": [0, index, 2]})
    full = load_full_state(tmp_path)
    assert torch.equal(full.params["w"], weight) and torch.equal(full.params["b"], bias)
    assert torch.equal(full.optim["w"]["exp_avg"].view(4, 6), weight * 10)
    assert full.shapes["w"] == (4, 6)

    # into a model split three ways along the same dim, part 2
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(4, 2))
    model.b = torch.nn.Parameter(torch.zeros(4))
    model.norm = torch.nn.Parameter(torch.zeros(3))
    mark_split(model.w, dim=1, index=2, parts=3)
    local = load_full_state(tmp_path, module=model)
    assert torch.equal(local.params["w"], weight[:, 4:6])
    assert torch.equal(local.optim["w"]["exp_avg"], (weight[:, 4:6] * 10).reshape(-1))
    assert torch.equal(local.params["b"], bias)  # not split in this model: the global tensor
    assert local.shapes["w"] == (4, 2)


def test_missing_part_and_indivisible_split_are_named(tmp_path: Path) -> None:
    _write(tmp_path, 0, {"w": torch.ones(2, 2)}, {"w": [0, 0, 2]})
    with pytest.raises(ckpt_io.CheckpointError, match=r"parts \[0\] of 'w' but not \[1\]"):
        load_full_state(tmp_path)
    other = tmp_path / "b"
    other.mkdir()
    _write(other, 0, {"w": torch.ones(3, 2)}, {})
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(1, 2))
    mark_split(model.w, dim=0, index=0, parts=2)
    with pytest.raises(ckpt_io.CheckpointError, match="does not divide"):
        load_full_state(other, module=model)


def test_replicas_and_other_stages_files_are_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, 0, {"a": torch.ones(2)}, {})
    _write(tmp_path, 1, {"a": torch.ones(2)}, {})  # a replica (e.g. the other tensor-parallel rank)
    _write(tmp_path, 2, {"z": torch.ones(2)}, {})  # another pipeline stage's parameter
    opened: list[str] = []
    real = ckpt_io.load_tensors
    monkeypatch.setattr(ckpt_io, "load_tensors", lambda path, *a, **k: (opened.append(Path(path).name), real(path, *a, **k))[1])

    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.zeros(2))

        def pipeline_state_keys(self) -> set[str]:  # a pipeline stage: the whole model has "a" and "z"
            return {"a", "z"}

    full = load_full_state(tmp_path, module=Stage())
    assert opened == [rank_files(0)[0]]
    assert set(full.params) == {"a"}


def test_grid_from_config_mesh_param_and_pipeline_module() -> None:
    assert dims_from_config({}, 4) == ParallelDims(dp=4)
    assert dims_from_config({"tensor_parallel": {"autotp_size": 2}}, 8) == ParallelDims(dp=4, tp=2)
    assert dims_from_config({}, 4, mesh_param=(2, 2)) == ParallelDims(dp=2, tp=2)

    class Pipe:
        num_stages = 2

    assert dims_from_config({}, 8, model=Pipe(), mesh_param=(2, 2)) == ParallelDims(pp=2, dp=2, tp=2)
    with pytest.raises(ConfigError, match="pipeline.stages is 4 but the PipelineModule was built with num_stages=2"):
        dims_from_config({"pipeline": {"stages": 4}}, 8, model=Pipe())
    with pytest.raises(ConfigError, match="mesh_param gives tensor parallel size 4 but tensor_parallel.autotp_size is 2"):
        dims_from_config({"tensor_parallel": {"autotp_size": 2}}, 8, mesh_param=(2, 4))
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by pipeline x sequence x tensor = 1 x 1 x 4"):
        dims_from_config({"tensor_parallel": {"autotp_size": 4}}, 6)
    with pytest.raises(ConfigError, match="mesh_param must be a pair"):
        dims_from_config({}, 4, mesh_param=3)


def test_a_stage_skips_another_stages_parts_in_a_shared_file(tmp_path: Path) -> None:
    """A rank file holding this stage's tensor and one tensor-parallel part of another stage's (a flat
    ZeRO partition spans layers): the stage loads, without asking for the other part."""
    _write(tmp_path, 0, {"a": torch.ones(2), "z": torch.ones(2)}, {"z": [0, 0, 2]})
    _write(tmp_path, 1, {"y": torch.ones(2)}, {})  # the other stage's own file, with z's part 1 absent

    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.zeros(2))

        def pipeline_state_keys(self) -> set[str]:
            return {"a", "y", "z"}

    full = load_full_state(tmp_path, module=Stage())
    assert set(full.params) == {"a"} and torch.equal(full.params["a"], torch.ones(2))
