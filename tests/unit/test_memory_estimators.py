"""DeepSpeed's estimator names and formulas, the tensor-memory tracker and the activation dry run."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from deepshard.profiling.ds_estimators import (estimate_zero2_model_states_mem_needs,
                                               estimate_zero2_model_states_mem_needs_all_live,
                                               estimate_zero3_model_states_mem_needs,
                                               estimate_zero3_model_states_mem_needs_all_cold,
                                               estimate_zero3_model_states_mem_needs_all_live)
from deepshard.profiling.memory_estimator import ModelFacts, activation_bytes, model_state_bytes
from deepshard.profiling.memory_tracker import TensorMemoryTracker


def test_zero2_and_zero3_formulas() -> None:
    p = 1_000_000
    assert estimate_zero2_model_states_mem_needs(p, 4, 1, cpu_offload=False) == (int(p * 4 * 4 * 1.5), 2 * p + 18 * p // 4)
    assert estimate_zero2_model_states_mem_needs(p, 4, 2, cpu_offload=True) == (int(p * 32 * 1.5), 2 * p)
    largest = 10_000
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(p, largest, 8, 1, cpu_offload=False, cpu_offload_params=False)
    assert gpu == 4 * largest + 18 * p // 8 and cpu == int(largest * 4 * 8 * 1.5)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(p, largest, 8, 2, cpu_offload=True, cpu_offload_params=False)
    assert gpu == 4 * largest + 2 * p // 16
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(p, largest, 8, 2)
    assert gpu == 4 * largest and cpu == int(p * 18 * 0.5 * 1.5)


def test_table_output(capsys) -> None:
    model = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 10))
    text = estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    assert capsys.readouterr().out.strip() == text.strip()
    from deepshard.zero.offload_config import OffloadDeviceEnum

    cpu_label = f"{OffloadDeviceEnum.cpu:4}"  # what DeepSpeed prints for the device (Python-version dependent)
    assert "per CPU  |  per GPU |   Options" in text and f"offload_optimizer={cpu_label}" in text
    assert "1M total params" in text
    text3 = estimate_zero3_model_states_mem_needs_all_live(model)
    # DeepSpeed's six rows: both offloaded, optimizer offloaded, nothing offloaded; each with zero_init 1 and 0
    assert sum("GB |" in line for line in text3.splitlines()) == 6 and "zero_init=1" in text3
    assert f"offload_param={cpu_label}, offload_optimizer={cpu_label}, zero_init=0" in text3
    assert estimate_zero3_model_states_mem_needs_all_cold(1_001_010, 1_001_000) == text3


class Block(nn.Module):
    def __init__(self, d: int, ckpt: bool) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.ff = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + (checkpoint(self.ff, h, use_reentrant=False) if self.ckpt else self.ff(h))


def measured_activations(model: nn.Module, x: torch.Tensor) -> int:
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda t: setattr(t, "grad", None))
    with TensorMemoryTracker() as tracker:
        base = tracker.current_bytes
        model(x).float().sum().backward()  # how the dry run reduces a non-scalar output
    return tracker.peak_bytes - base


def test_activation_dry_run_equals_the_measured_run() -> None:
    for ckpt in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            model = nn.Sequential(*(Block(64, ckpt) for _ in range(3))).to(dtype)
            x = torch.randn(32, 64, dtype=dtype)
            estimate = activation_bytes(model, (x,), dtype)
            assert estimate == measured_activations(model, x), (ckpt, dtype)
            assert all(p.device.type == "cpu" and not p.is_meta for p in model.parameters())  # model put back
    # checkpointing keeps only block inputs (plus one block recomputed during backward)
    full = activation_bytes(nn.Sequential(*(Block(64, False) for _ in range(3))), (torch.randn(32, 64),), torch.float32)
    ckpt = activation_bytes(nn.Sequential(*(Block(64, True) for _ in range(3))), (torch.randn(32, 64),), torch.float32)
    assert ckpt < 0.6 * full


def test_tracker_sees_temporaries_and_frees() -> None:
    with TensorMemoryTracker() as tracker:
        base = tracker.current_bytes
        a = torch.empty(1000)  # 4000 bytes
        b = torch.empty(500)
        del a
        c = torch.empty(10)
    assert tracker.peak_bytes - base == 6000
    assert tracker.current_bytes - base == 2040
    del b, c


def test_model_states_follow_the_zero_table() -> None:
    model = nn.Sequential(nn.Linear(300, 400), nn.Linear(400, 300))
    facts = ModelFacts.of(model)
    psi = facts.trainable
    for stage, fp32, bf16 in ((0, 16 * psi, 16 * psi), (1, 8 * psi + 8 * psi // 4, 4 * psi + 12 * psi // 4),
                              (2, 4 * psi + 12 * psi // 4, 2 * psi + 14 * psi // 4)):
        assert sum(model_state_bytes(facts, stage, 4, 4, 8).values()) == fp32
        assert sum(model_state_bytes(facts, stage, 4, 2, 8).values()) == bf16
    stage3 = model_state_bytes(facts, 3, 4, 2, 8, persistence_threshold=0)
    assert abs(sum(stage3.values()) - 16 * psi // 4) <= 16 * 4  # padding to a multiple of 4 per group


def tiny_model() -> nn.Module:
    return nn.Sequential(Block(32, False), Block(32, True))


def tiny_inputs(micro: int) -> tuple[torch.Tensor]:
    return (torch.randn(micro, 32),)


def test_estimate_command(tmp_path, capsys) -> None:
    import json

    from deepshard.profiling.estimate_cli import main

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                               "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    here = "tests.unit.test_memory_estimators"
    assert main(["--config", str(cfg), "--model", f"{here}:tiny_model", "--inputs", f"{here}:tiny_inputs",
                 "--dp", "2"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO stage 2, torch.bfloat16, 2 data-parallel" in out and "estimated peak" in out
    assert out.count("per CPU  |  per GPU |   Options") == 2
    assert main(["--config", str(cfg), "--model", "no_colon", "--inputs", f"{here}:tiny_inputs"]) == 2
    assert "package.module:function" in capsys.readouterr().err
