"""The inventory of DeepSpeed engine methods (tests/compat_inventory/engine_methods.tsv): on a real deepshard
engine each ``real`` entry exists (config accessors are called and answer), each ``refused`` one raises an
error that names what to use instead; plus the behaviour of the non-accessor calls."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import deepshard
from deepshard.pipe import PipelineModule
from tests.deepspeed_compat.accessor_worker import ACCESSORS, PROPERTIES

TSV = Path(__file__).resolve().parents[1] / "compat_inventory" / "engine_methods.tsv"
CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
       "steps_per_print": 3, "gradient_clipping": 0.25}


def _entries() -> list[tuple[str, str, str, int]]:
    rows = [line.split("\t") for line in TSV.read_text().splitlines() if not line.startswith("#")]
    assert rows[0] == ["name", "engine", "expect", "uses", "sources"]
    return [(name, engine, expect, int(uses)) for name, engine, expect, uses, _ in rows[1:]]


@pytest.fixture(scope="module")
def engines() -> dict[str, Any]:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    piped = PipelineModule([nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)], num_stages=1, loss_fn=nn.MSELoss())
    return {"plain": deepshard.initialize(model=plain, config=CFG)[0],
            "pipe": deepshard.initialize(model=piped, config=CFG)[0]}


def test_inventory_is_whole() -> None:
    entries = _entries()
    names = {e[0] for e in entries}
    assert len(names) == len(entries) >= 130
    assert set(ACCESSORS + PROPERTIES) <= names
    assert sum(e[3] > 0 for e in entries) >= 30  # the client-called methods
    assert all(e[1] in ("both", "pipe", "plain") and e[2] in ("real", "refused") for e in entries)


def test_every_entry_is_real_or_refused_with_what_to_use(engines: dict[str, Any]) -> None:
    wrong = []
    for name, engine_kind, expect, _ in _entries():
        kinds = {"pipe": ["pipe"], "plain": ["plain"], "both": ["plain", "pipe"]}[engine_kind]
        for engine in (engines[kind] for kind in kinds):
            where = f"{type(engine).__name__}.{name}"
            if expect == "refused":
                with pytest.raises(NotImplementedError) as info:
                    getattr(engine, name)()
                if "deepshard" not in str(info.value) or not ("use " in str(info.value) or "instead" in str(info.value)):
                    wrong.append(f"{where}: refusal does not say what to use: {info.value}")
                continue
            value = getattr(engine, name, None)
            if value is None:
                wrong.append(f"{where}: missing")
            elif name in ACCESSORS:
                value()  # an accessor answers without arguments
    assert not wrong, "\n".join(wrong)


def test_accessors_read_the_config(engines: dict[str, Any]) -> None:
    for engine in engines.values():
        assert engine.steps_per_print() == 3 and engine.gradient_clipping() == 0.25
        assert engine.optimizer_name() == "adamw" and engine.optimizer_params() == {"lr": 1e-2}
        assert engine.zero_optimization() is False and engine.zero_optimization_partition_weights() is False
        assert engine.zero_offload_optimizer() is None and engine.random_ltd_enabled() is False
        assert engine.get_data_types() == (torch.float32, torch.float32)
        assert engine.communication_data_type == torch.float32
        assert engine.get_batch_info() == (2, 2, 1)


def test_client_calls(engines: dict[str, Any]) -> None:
    engine = engines["plain"]
    loader = engine.deepspeed_io(torch.utils.data.TensorDataset(torch.randn(8, 4)))
    engine.training_dataloader = loader
    engine.set_data_post_process_func(len)
    assert loader.post_process_func is len  # type: ignore[attr-defined]
    engine.empty_partition_cache()
    assert engine.get_compile_time() == {}
    engines["pipe"].reset_activation_shape()
