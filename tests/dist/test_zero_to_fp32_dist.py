"""zero_to_fp32 on checkpoints written by a world of 2: the consolidated fp32 weights are exactly what the
ranks reported through ``safe_get_full_fp32_param`` while training (stage 0 writes one file; stages 1-2
write one per rank, and the same test covers them once they are added to ``STAGES``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                          get_fp32_state_dict_from_zero_checkpoint,
                                          load_state_dict_from_zero_checkpoint)
from tests.dist.harness import run_world
from tests.dist.scenarios_zero_to_fp32 import TiedNet, consolidate_world

STAGES = (0,)  # add 1, 2 when their strategies land
WORLD = 2


@pytest.mark.parametrize("stage", STAGES)
def test_consolidated_weights_equal_what_every_rank_reports(tmp_path: Path, stage: int) -> None:
    save_dir = tmp_path / "ckpt"
    reports = run_world(consolidate_world, WORLD, str(save_dir), stage)
    assert [r["dp_world_size"] for r in reports] == [WORLD] * WORLD
    sd = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    assert set(sd) == set(TiedNet().state_dict())
    assert sd["head.weight"] is sd["embed.weight"]
    for rank, report in enumerate(reports):
        for name, value in report["fp32"].items():
            assert sd[name].dtype == torch.float32
            assert torch.equal(sd[name], value), f"rank {rank}: {name} differs from safe_get_full_fp32_param"
        for name, value in {**report["buffers"], **report["frozen"]}.items():
            assert torch.equal(sd[name], value.float() if value.is_floating_point() else value), (rank, name)
    # bf16 training: the fp32 masters carry bits the 16-bit module weights lost
    module = reports[0]["module"]
    assert any(not torch.equal(sd[n], module[n].float()) for n in reports[0]["fp32"])
    _check_outputs_reload(save_dir, tmp_path, sd)


def _check_outputs_reload(save_dir: Path, tmp_path: Path, sd: dict[str, Any]) -> None:
    out = tmp_path / "hf"
    convert_zero_checkpoint_to_fp32_state_dict(save_dir, out, safe_serialization=True, max_shard_size="300B")
    from safetensors.torch import load_file

    reloaded: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("model-*.safetensors")):
        reloaded.update(load_file(str(f)))
    assert len(list(out.glob("model-*.safetensors"))) > 1
    assert set(reloaded) == set(sd) and all(torch.equal(reloaded[k], sd[k]) for k in sd)
    model = load_state_dict_from_zero_checkpoint(TiedNet(), save_dir)
    for name, value in model.state_dict().items():
        assert torch.equal(value, sd[name]), name
