"""zero_to_fp32 on checkpoints written by a world of 2: the consolidated fp32 weights are exactly what the
ranks reported through ``safe_get_full_fp32_param`` while training. Stage 0 writes one fragment file;
stages 1-2 write one per rank, each holding its partition, so reassembly across files is covered."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                          get_fp32_state_dict_from_zero_checkpoint,
                                          load_state_dict_from_zero_checkpoint)
from tests.multiproc.harness import run_world
from tests.multiproc.scenarios_zero_to_fp32 import TiedNet, consolidate_world

STAGES = (0, 1, 2, 3)
WORLD = 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[int, Any]]]:
    """One world saves a checkpoint per stage (``root/stage<N>``); returns the root and every rank's reports."""
    root = tmp_path_factory.mktemp("z2fp32_dist")
    return root, run_world(consolidate_world, WORLD, str(root), STAGES)


@pytest.mark.parametrize("stage", STAGES)
def test_consolidated_weights_equal_what_every_rank_reports(saved: tuple[Path, list], stage: int) -> None:
    root, reports = saved
    save_dir = root / f"stage{stage}"
    assert [(r[stage]["zero_stage"], r[stage]["dp_world_size"]) for r in reports] == [(stage, WORLD)] * WORLD
    rank_files = sorted(p.name for p in save_dir.glob("global_step2/zero_rank*.safetensors"))
    assert len(rank_files) == (1 if stage == 0 else WORLD), rank_files
    sd = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    assert set(sd) == set(TiedNet().state_dict())
    assert sd["head.weight"] is sd["embed.weight"]
    for rank, report in enumerate(r[stage] for r in reports):
        for name, value in report["fp32"].items():
            assert sd[name].dtype == torch.float32
            assert torch.equal(sd[name], value), f"rank {rank}: {name} differs from safe_get_full_fp32_param"
        for name, value in {**report["buffers"], **report["frozen"]}.items():
            assert torch.equal(sd[name], value.float() if value.is_floating_point() else value), (rank, name)
    # bf16 training: the fp32 masters carry bits the 16-bit module weights lost
    module = reports[0][stage]["module"]
    assert any(not torch.equal(sd[n], module[n].float()) for n in reports[0][stage]["fp32"])


def test_outputs_and_model_load_from_a_partitioned_checkpoint(saved: tuple[Path, list], tmp_path: Path) -> None:
    root, _ = saved
    stage = max(STAGES)
    save_dir = root / f"stage{stage}"
    sd = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    out = tmp_path / "hf"
    convert_zero_checkpoint_to_fp32_state_dict(save_dir, out, safe_serialization=True, max_shard_size="300B")
    from safetensors.torch import load_file

    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1
    reloaded: dict[str, torch.Tensor] = {}
    for f in shards:
        reloaded.update(load_file(str(f)))
    assert set(reloaded) == set(sd) and all(torch.equal(reloaded[k], sd[k]) for k in sd)
    model = load_state_dict_from_zero_checkpoint(TiedNet(), save_dir)
    for name, value in model.state_dict().items():
        assert torch.equal(value, sd[name]), name
