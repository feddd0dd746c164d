"""Automatic TP's decisions with no process group: naming rules, config overrides, the errors that name
the unclassifiable layers and the head arithmetic, tp_model_init's record and conflicts."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from deepshard.tp.autotp import plan_model
from deepshard.tp.autotp_config import parse_tp_config, resolve_tp_config, tp_model_init
from deepshard.tp.params import shard_of, unshard
from tests.multiproc.tp_models import LlamaLike, LlamaLikeConfig


def _kinds(model: nn.Module, section: dict) -> dict[str, str]:
    return {name: d.kind for name, d in plan_model(model, parse_tp_config(section)).items()}


def test_llama_naming_rules() -> None:
    kinds = _kinds(LlamaLike(), {"autotp_size": 2})
    assert kinds["embed_tokens"] == "vocab" and kinds["lm_head"] == "gather"
    for leaf in ("q_proj", "k_proj", "v_proj"):
        assert kinds[f"layers.1.self_attn.{leaf}"] == "column"
    assert kinds["layers.0.self_attn.o_proj"] == "row" and kinds["layers.0.mlp.down_proj"] == "row"
    assert kinds["layers.0.mlp.gate_proj"] == kinds["layers.0.mlp.up_proj"] == "column"


def test_tied_head_and_embedding_stay_replicated() -> None:
    model = LlamaLike()
    model.lm_head.weight = model.embed_tokens.weight
    kinds = _kinds(model, {"autotp_size": 2})
    assert kinds["embed_tokens"] == "skip"
    assert "lm_head" not in kinds or kinds["lm_head"] == "skip"


def test_partition_config_overrides_the_rules() -> None:
    section = {"autotp_size": 2, "partition_config": {"layer_specs": [
        {"patterns": [r"mlp\.down_proj$"], "partition_type": "skip"},
        {"patterns": [r"\.q_proj$"], "partition_type": "column", "shape": [8, 8]}]}}
    plan = plan_model(LlamaLike(), parse_tp_config(section))
    assert plan["layers.0.mlp.down_proj"].kind == "skip" and plan["layers.0.mlp.down_proj"].source == "config"
    assert plan["layers.1.self_attn.q_proj"].parts == (8, 8)
    assert plan["layers.0.self_attn.o_proj"].kind == "row"  # untouched rules still apply


def test_unclassifiable_layers_are_named() -> None:
    model = LlamaLike()
    model.layers[0].mlp.mystery = nn.Linear(16, 16)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.mystery \(Linear \(16, 16\)\).*layer_specs"):
        plan_model(model, parse_tp_config({"autotp_size": 2}))


def test_tp_must_divide_the_heads() -> None:
    with pytest.raises(ValueError, match=r"tensor-parallel size 4 does not divide the model's 2 key/value heads.*"
                                         r"\[1, 2\]"):
        plan_model(LlamaLike(LlamaLikeConfig(num_key_value_heads=2)), parse_tp_config({"autotp_size": 4}))
    with pytest.raises(ValueError, match=r"size 3 does not divide the model's 4 attention heads"):
        plan_model(LlamaLike(), parse_tp_config({"autotp_size": 3}))


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"layer_specs\[0\]\.partition_type is 'diagonal'"):
        parse_tp_config({"autotp_size": 2, "partition_config": {"layer_specs": [
            {"patterns": ["x"], "partition_type": "diagonal"}]}})
    with pytest.raises(ValueError, match="autotp_size \\(2\\) and tensor_parallel.tp.tp_size \\(4\\) disagree"):
        parse_tp_config({"autotp_size": 2, "tp": {"tp_size": 4}})
    assert not parse_tp_config({"autotp_size": 1}).enabled and not parse_tp_config(None).enabled


def test_tp_model_init_records_and_conflicts() -> None:
    model = tp_model_init(LlamaLike(), tp_size=2, dtype=torch.bfloat16)
    cfg = resolve_tp_config(model, None)
    assert cfg.tp_size == 2 and cfg.dtype == torch.bfloat16
    assert resolve_tp_config(model, {"autotp_size": 2}).tp_size == 2
    with pytest.raises(ValueError, match=r"tp_model_init\(tp_size=2\) conflicts .*autotp_size=4"):
        resolve_tp_config(model, {"autotp_size": 4})
    with pytest.raises(ValueError, match="tp_size=2 but config autotp_size=4"):
        tp_model_init(LlamaLike(), 2, config={"autotp_size": 4})


def test_fused_shards_round_trip() -> None:
    full = torch.arange(24.0).reshape(12, 2)  # q: 6 rows, k: 3, v: 3
    parts = (6, 3, 3)
    shards = [shard_of(full, 0, r, 3, parts) for r in range(3)]
    assert torch.equal(shards[1][:2], full[2:4]) and torch.equal(shards[1][2:3], full[7:8])
    assert torch.equal(unshard(shards, 0, parts), full)
    assert torch.equal(unshard([shard_of(full, 1, r, 2) for r in range(2)], 1), full)
