"""The plan check (deepshard/plan.py): every combination deepshard cannot build is refused before anything
is built, all conflicts listed at once, each naming both sides, the reason and the fix; valid plans pass."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from deepshard.compression.onebit_adam import OneBitAdam
from deepshard.config import ConfigError, load_config
from deepshard.pipe import PipelineModule
from deepshard.plan import PlanError, check, describe, enforce
from deepshard.topology import ParallelDims


def _cfg(**sections: Any) -> Any:
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    return load_config({**base, **sections}, dp_world_size=1)


def _pipe(chunks: int = 1) -> PipelineModule:
    return PipelineModule([nn.Linear(4, 4) for _ in range(4)], num_stages=2, stage_id=0, num_chunks=chunks)


def _messages(cfg: Any, model: nn.Module, dims: ParallelDims = ParallelDims(), optimizer: Any = None) -> list[str]:
    return [str(c) for c in check(describe(cfg, model, dims, optimizer))]


@pytest.mark.parametrize("sections, model, dims, needle", [
    ({"zero_optimization": {"stage": 3}}, "pipe", ParallelDims(pp=2), "stage=3 cannot be combined with pipeline"),
    ({"pipeline": {"schedule": "interleaved"}}, "pipe", ParallelDims(pp=2), "num_chunks=2"),
    ({}, "pipe2", ParallelDims(pp=2), "set pipeline.schedule to 'interleaved'"),
    ({"tensor_parallel": {"autotp_size": 2}}, "pipe", ParallelDims(pp=2, tp=2), "automatic TP"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "nvme", "nvme_path": "NVME"}}}, "plain",
     ParallelDims(), "needs ZeRO stage 1, 2 or 3"),
    ({"bf16": {"enabled": True}, "gradient_accumulation_steps": 4, "data_types": {"grad_accum_dtype": "fp32"}},
     "plain", ParallelDims(), r"4 micro-batches in the training dtype \(torch.bfloat16\) outside pipelines"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}, "plain",
     ParallelDims(), "zero_optimization.stage 0, got 2"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}, "plain", ParallelDims(tp=2), "model-parallel"),
    ({"zero_optimization": {"stage": 2, "optimizer_step_in_backward": True}}, "plain", ParallelDims(), "stage is 2"),
    ({"zero_optimization": {"stage": 3, "optimizer_step_in_backward": True}}, "plain", ParallelDims(tp=2),
     "grid is grid"),
    ({}, "plain", ParallelDims(sp=2, pp=2), "sequence_parallel_size=2 with pipeline stages"),
])
def test_each_rule_refuses_with_its_reason(sections: dict, model: str, dims: ParallelDims, needle: str,
                                           tmp_path: Path) -> None:
    offload = sections.get("zero_optimization", {}).get("offload_optimizer")
    if offload:
        offload["nvme_path"] = str(tmp_path)
    module = {"plain": nn.Linear(4, 4), "pipe": _pipe(), "pipe2": _pipe(chunks=2)}[model]
    found = _messages(_cfg(**sections), module, dims)
    assert len(found) == 1 and __import__("re").search(needle, found[0]), found


def test_every_conflict_is_listed_at_once() -> None:
    cfg = _cfg(optimizer={"type": "OneBitAdam", "params": {"lr": 1e-3}}, zero_optimization={"stage": 3},
               pipeline={"schedule": "interleaved"})
    with pytest.raises(PlanError) as err:
        enforce(describe(cfg, _pipe(), ParallelDims(pp=2)))
    assert len(err.value.conflicts) == 4  # stage 3 x pipeline, interleaved x one chunk, OneBitAdam x stage, x mp
    text = str(err.value)
    assert text.startswith("this run combines 4 things") and all(f"  {i}. " in text for i in range(1, 5))
    assert isinstance(err.value, ConfigError) and isinstance(err.value, ValueError)  # what callers catch
    # re-raised across processes (multiprocessing pickles it): the same conflicts and message, not its characters
    again = __import__("pickle").loads(__import__("pickle").dumps(err.value))
    assert type(again) is PlanError and again.conflicts == err.value.conflicts and str(again) == text


def test_a_compressed_optimizer_instance_is_checked_like_the_config_type() -> None:
    params = [nn.Parameter(torch.zeros(2))]
    assert _messages(_cfg(zero_optimization={"stage": 1}), nn.Linear(2, 2), optimizer=OneBitAdam(params)) != []
    assert _messages(_cfg(zero_optimization={"stage": 0}), nn.Linear(2, 2), optimizer=OneBitAdam(params)) == []
    assert _messages(_cfg(zero_optimization={"stage": 3}), nn.Linear(2, 2), ParallelDims(tp=2),
                     optimizer=torch.optim.Adam(params)) == []  # other optimizers: no rule


@pytest.mark.parametrize("sections, model, dims", [
    ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "gradient_accumulation_steps": 3}, "pipe",
     ParallelDims(pp=2, dp=2)),
    ({"zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2}}, "plain", ParallelDims(tp=2)),
    ({"zero_optimization": {"stage": 3, "optimizer_step_in_backward": True}, "gradient_clipping": 0}, "plain",
     ParallelDims(dp=2)),
    ({"bf16": {"enabled": True}, "gradient_accumulation_steps": 4, "data_types": {"grad_accum_dtype": "fp32"}},
     "pipe", ParallelDims(pp=2)),
    ({"pipeline": {"schedule": "interleaved"}}, "pipe2", ParallelDims(pp=2)),
])
def test_valid_plans_pass(sections: dict, model: str, dims: ParallelDims) -> None:
    module = {"plain": nn.Linear(4, 4), "pipe": _pipe(), "pipe2": _pipe(chunks=2)}[model]
    assert _messages(_cfg(**sections), module, dims) == []


class _Attention(nn.Module):
    """An attention module that counts its heads (what automatic TP divides)."""

    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads = heads, kv_heads
        self.q_proj = nn.Linear(8, 8)


class _Configured(nn.Linear):
    """A model whose config names its head counts (as a Hugging Face model's does)."""

    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__(4, 4)
        self.config = type("Config", (), {"num_attention_heads": heads, "num_key_value_heads": kv_heads})()


@pytest.mark.parametrize("model, sections, dims, refused", [
    (_Configured(4, 2), {}, ParallelDims(tp=2, sp=2), False),           # GQA: 2 query + 1 kv head per tp rank
    (_Configured(4, 1), {}, ParallelDims(tp=2, sp=2), True),            # one kv head cannot split over tp=2
    (_Configured(6, 6), {}, ParallelDims(tp=4, sp=2), True),
    (_Attention(4, 4), {"tensor_parallel": {"autotp_size": 2}}, ParallelDims(tp=2, sp=2), False),
    (_Attention(3, 3), {"tensor_parallel": {"autotp_size": 2}}, ParallelDims(tp=2, sp=2), True),
    (_Attention(3, 3), {}, ParallelDims(tp=2, sp=2), False),            # the user's own TP layers: counts are theirs
])
def test_sequence_parallel_with_tensor_parallel_needs_whole_heads(model: nn.Module, sections: dict,
                                                                 dims: ParallelDims, refused: bool) -> None:
    found = _messages(_cfg(**sections), model, dims)
    if not refused:
        assert found == []
        return
    assert len(found) == 1, found
    heads, kv = (model.num_heads, model.num_key_value_heads) if isinstance(model, _Attention) else (
        model.config.num_attention_heads, model.config.num_key_value_heads)
    assert f"{heads} query heads and {kv} key/value heads" in found[0] and f"tp={dims.tp}" in found[0]
    assert "use a tensor-parallel size in [1" in found[0], found[0]
