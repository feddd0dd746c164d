"""The planner's search space and scoring, with no dry run: what is refused and why, the config each choice
writes, the headroom discount, sizes on the command line."""
from __future__ import annotations

import argparse

import pytest

from deepshard.dryrun.plan_cli import parse_bytes
from deepshard.dryrun.plan_space import Choice, Space, choices, config_for, refusal
from deepshard.dryrun.planner import Plan, Trial, format_plan, score


def test_refusals_name_the_reason() -> None:
    space = Space(world_size=8, global_batch=32)
    ok = dict(pipeline=True, checkpointable=True, tp_ok=True)
    assert refusal(Choice(1, 1, 2, "none", False, 4), space, **ok) is None
    assert "does not divide the world size 8" in refusal(Choice(3, 1, 1, "none", False, 1), space, **ok)
    assert "not a multiple of micro batch 8 x data-parallel size 8" in refusal(Choice(1, 1, 1, "none", False, 8), space, **ok)
    assert "stage 0 has no partition" in refusal(Choice(1, 1, 0, "optimizer", False, 1), space, **ok)
    assert "parameter offload needs ZeRO stage 3" in refusal(Choice(1, 1, 2, "optimizer+params", False, 1), space, **ok)
    assert "pipeline_layers" in refusal(Choice(1, 2, 1, "none", False, 1), space, False, True, True)
    assert "activation_checkpointing" in refusal(Choice(1, 1, 1, "none", True, 1), space, True, False, True)
    assert "tensor_parallel = False" in refusal(Choice(2, 1, 1, "none", False, 1), space, True, True, False)


def test_config_keeps_the_global_batch_and_writes_each_knob() -> None:
    space = Space(world_size=8, global_batch=64)
    base = {"train_batch_size": 64, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 0,
            "reduce_bucket_size": 1000, "offload_param": {"device": "cpu"}}}
    cfg = config_for(base, Choice(2, 2, 1, "optimizer", True, 4), space)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (64, 4, 8)
    assert cfg["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000, "offload_optimizer": {"device": "cpu"}}
    assert cfg["tensor_parallel"] == {"autotp_size": 2}
    assert cfg["pipeline"] == {"stages": 2, "activation_checkpoint_interval": 1}
    assert base["zero_optimization"]["stage"] == 0  # the base is not changed
    short = config_for(base, Choice(1, 1, 3, "none", False, 2), space, micro_steps=2)
    assert (short["train_batch_size"], short["gradient_accumulation_steps"]) == (32, 2) and "pipeline" not in short
    c = Choice(1, 4, 1, "none", False, 1)  # a pipeline holds a batch's sends: its dry run takes every micro-batch
    assert space.micro_steps(c) == 32 and space.dry_micro_steps(c) == 32
    flat = Choice(1, 1, 1, "none", False, 1)
    assert space.micro_steps(flat) == 8 and space.dry_micro_steps(flat) == 4
    listed = list(choices(Space(world_size=2, global_batch=8, tps=(1,), pps=(1,), stages=(1,), micros=(2, 1))))
    assert [x.micro for x in listed[:2]] == [1, 2] and not listed[0].checkpointing and listed[-1].checkpointing


def test_score_discounts_the_last_tenth_of_memory_and_refuses_what_does_not_fit() -> None:
    roomy, tight, over = (Trial(Choice(1, 1, 1, "none", False, 1), peak_bytes=p, step_s=1.0) for p in (50, 95, 101))
    for t in (roomy, tight, over):
        score(t, global_batch=10, memory_bytes=100, bandwidth=1e9)
    assert roomy.fits and roomy.score == pytest.approx(10.0)
    assert tight.fits and tight.score == pytest.approx(5.0)  # 5% headroom: half the throughput counted
    assert not over.fits and over.score == 0 and "exceeds the memory per rank" in over.reason
    plan = Plan(Space(2, 10), 100, 1e9, [roomy, tight, over, Trial(Choice(2, 1, 1, "none", False, 1), reason="why")], roomy)
    text = format_plan(plan)
    assert "pick: tp=1 pp=1 zero=1 micro=1" in text and "refused x1: why" in text


def test_sizes_on_the_command_line() -> None:
    assert parse_bytes("40GiB") == 40 * 2**30 and parse_bytes("1.5g") == int(1.5 * 2**30)
    assert parse_bytes("800MB") == 800 * 10**6 and parse_bytes("123") == 123
    with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
        parse_bytes("lots")
