"""Expert-parallel groups as pure rank arithmetic (DeepSpeed's layout, read from its
``groups._create_expert_and_data_parallel``), global expert names, and the plan check's MoE rules."""
from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from deepshard.config import load_config
from deepshard.moe.layer import MoE
from deepshard.moe.parallel import saved_expert_name
from deepshard.plan import check, describe
from deepshard.topology import ParallelDims, TopologyError


def test_default_layout_is_expert_blocks_and_strided_replicas() -> None:
    ep, edp = ParallelDims(dp=8).expert_group_ranks(2)
    assert ep == [[0, 1], [2, 3], [4, 5], [6, 7]] and edp == [[0, 2, 4, 6], [1, 3, 5, 7]]
    ep, edp = ParallelDims(dp=4).expert_group_ranks(4)
    assert ep == [[0, 1, 2, 3]] and edp == [[0], [1], [2], [3]]
    ep, edp = ParallelDims(dp=2).expert_group_ranks(1)
    assert ep == [[0], [1]] and edp == [[0, 1]]


def test_data_before_expert_swaps_the_two() -> None:
    ep, edp = ParallelDims(dp=8).expert_group_ranks(2, data_before_expert=True)
    assert ep == [[0, 4], [1, 5], [2, 6], [3, 7]] and edp == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_groups_stay_inside_a_pipeline_stage_and_sizes_must_divide() -> None:
    ep, edp = ParallelDims(pp=2, dp=4).expert_group_ranks(2)
    assert ep == [[0, 1], [2, 3], [4, 5], [6, 7]] and edp == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(TopologyError, match="expert-parallel size 3 does not divide the 4 data-parallel replicas"):
        ParallelDims(dp=4).expert_group_ranks(3)


def test_saved_names_carry_the_global_expert_id() -> None:
    layer = MoE(8, nn.Linear(8, 8), num_experts=6, ep_size=3)
    assert saved_expert_name("blocks.2.moe.deepspeed_moe.experts.deepspeed_experts.1.weight", layer, 2) == \
        "blocks.2.moe.deepspeed_moe.experts.deepspeed_experts.5.weight"
    assert saved_expert_name("deepspeed_moe.experts.deepspeed_experts.0.0.bias", layer, 1) == \
        "deepspeed_moe.experts.deepspeed_experts.2.0.bias"


def _messages(model: nn.Module, dims: ParallelDims, **sections: Any) -> list[str]:
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                       **sections}, dp_world_size=dims.dp)
    return [str(c) for c in check(describe(cfg, model, dims))]


def _moe(ep: int) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), MoE(8, nn.Linear(8, 8), num_experts=4, ep_size=ep))


@pytest.mark.parametrize("ep, dims, sections, needle", [
    (4, ParallelDims(dp=2), {}, "ep_size=4 on 2 data-parallel replicas"),
    (2, ParallelDims(dp=2, tp=2), {}, "tensor parallelism"),
    (2, ParallelDims(dp=2, sp=2), {}, "sequence parallelism"),
    (2, ParallelDims(dp=2), {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}, "OneBitAdam"),
])
def test_plan_refuses_what_expert_parallelism_cannot_meet(ep: int, dims: ParallelDims, sections: dict,
                                                          needle: str) -> None:
    messages = _messages(_moe(ep), dims, **sections)
    assert any(needle in m for m in messages), messages


@pytest.mark.parametrize("ep, stage", [(1, 0), (2, 0), (2, 1), (2, 2), (1, 3), (2, 3)])
def test_plan_accepts_what_it_builds(ep: int, stage: int) -> None:
    assert _messages(_moe(ep), ParallelDims(dp=2), zero_optimization={"stage": stage}) == []


def test_whole_state_dict_names_experts_by_global_id_in_model_order() -> None:
    from deepshard.checkpoint.experts import whole_state_dict
    from deepshard.comm.group import CommGroup
    from deepshard.moe.parallel import _with_expert_id
    from deepshard.placement import mark_expert

    model = nn.Sequential(nn.Linear(8, 8), MoE(8, nn.Linear(8, 8), num_experts=4, ep_size=2), nn.Linear(8, 2))
    for name, p in model[1].deepspeed_moe.experts.named_parameters(prefix="1.deepspeed_moe.experts"):
        mark_expert(p, "ep_size_2", saved_expert_name(name, model[1], 1),
                    tuple(_with_expert_id(name, g) for g in range(4)))  # as expert-parallel rank 1 sees them
    state = whole_state_dict(model.state_dict(), model, CommGroup.single())
    assert list(state) == ["0.weight", "0.bias", "1.deepspeed_moe.gate.wg.weight",
                           "1.deepspeed_moe.experts.deepspeed_experts.2.weight",
                           "1.deepspeed_moe.experts.deepspeed_experts.2.bias",
                           "1.deepspeed_moe.experts.deepspeed_experts.3.weight",
                           "1.deepspeed_moe.experts.deepspeed_experts.3.bias", "2.weight", "2.bias"]
