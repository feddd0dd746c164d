"""A 2-stage pipeline's 16-bit file holds both stages' layers; each stage loads only its own rank files."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multiproc.harness import run_world
from tests.multiproc.scenarios_pipe_files import pipe_files_world


@pytest.fixture(scope="module")
def pipe_files(tmp_path_factory: Any) -> list[dict[str, Any]]:
    return run_world(pipe_files_world, 2, str(tmp_path_factory.mktemp("pipe_files")), timeout=300)


def test_save_16bit_model_writes_every_stage_into_one_file(pipe_files: list[dict[str, Any]]) -> None:
    first, second = pipe_files
    assert first["saved"] and second["saved"]
    state = first["file"]
    assert sorted(state) == first["all_keys"]  # stage 0's layers and stage 1's, the tied embedding once
    for name, value in first["whole"].items():
        torch.testing.assert_close(state[name].float(), value, rtol=0, atol=0, msg=lambda s: f"{name}: {s}")


def test_each_stage_reads_only_its_own_rank_files(pipe_files: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(pipe_files):
        assert result["reads"] == [f"zero_rank{rank}.safetensors"]  # not the other stage's (no buffers here)
        for name, value in result["loaded"].items():
            torch.testing.assert_close(value, result["whole"][name], rtol=0, atol=0)


def test_wanted_names_of_a_stage_are_its_own(tmp_path: Path) -> None:
    from deepshard.checkpoint.layout import wanted_names
    from deepshard.pipe import PipelineModule
    from tests.multiproc.scenarios_pipe import layers, lm_loss

    stage1 = PipelineModule(layers(), num_stages=2, stage_id=1, loss_fn=lm_loss)
    names = wanted_names(stage1)
    assert names is not None and names == set(stage1.state_dict())
    assert not any(name.startswith("1.") for name in names)  # block 1 lives on stage 0
    assert wanted_names(torch.nn.Linear(2, 2)) is None
