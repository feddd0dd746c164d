"""The engine's generated config accessors (``deepshard/engine_accessors_generated.py``): the committed file is
what the generator writes from the tables, and each table entry reads a real ``DeepShardConfig`` field of the
type it declares."""
from __future__ import annotations

import functools
import importlib.util
import typing
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import pytest

from deepshard.config import load_config
from deepshard.config.zero import OffloadOptimizerConfig, OffloadParamConfig
from deepshard.engine import DeepShardEngine
from deepshard.engine_accessor_specs import CONFIG_READS, DISABLED_FEATURES
from deepshard.engine_accessors_generated import GeneratedAccessors

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_engine_accessors", ROOT / "tools" / "gen_engine_accessors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_file_is_what_the_generator_writes(generator: ModuleType) -> None:
    committed = generator.TARGET.read_text()
    assert committed == generator.render(), ("src/deepshard/engine_accessors_generated.py differs from the tables in "
                                            "deepshard/engine_accessor_specs.py: run python tools/gen_engine_accessors.py")


def test_every_accessor_is_a_method_of_the_engine_class() -> None:
    """Defined in source (visible to readers and type checkers), not attached at import."""
    names = set(CONFIG_READS) | set(DISABLED_FEATURES)
    assert names <= set(vars(GeneratedAccessors))
    assert all(getattr(DeepShardEngine, name) is vars(GeneratedAccessors)[name] for name in names)


def _strip(annotation: Any) -> Any:
    """``Annotated[X, ...]`` -> ``X``, inside Optional too."""
    if typing.get_origin(annotation) is typing.Annotated:
        return typing.get_args(annotation)[0]
    args = typing.get_args(annotation)
    if type(None) in args:
        inner = [_strip(a) for a in args if a is not type(None)]
        return Optional[inner[0]] if len(inner) == 1 else annotation
    return annotation


def test_each_read_names_a_config_field_of_its_declared_type(generator: ModuleType) -> None:
    names = {"Optional": Optional, "OffloadOptimizerConfig": OffloadOptimizerConfig,
             "OffloadParamConfig": OffloadParamConfig}
    wrong = []
    for name, (path, returns) in CONFIG_READS.items():
        declared = eval(returns, names, {})  # noqa: S307 - the table's own type names
        field = _strip(generator.field_annotation(path))
        if field != declared and field != Optional[declared]:
            wrong.append(f"{name}: {path} is {field}, declared {returns}")
    assert not wrong


@pytest.mark.parametrize("raw", [
    {"train_micro_batch_size_per_gpu": 2},
    {"train_batch_size": 12, "gradient_accumulation_steps": 3, "steps_per_print": 7, "gradient_clipping": 0.5,
     "fp16": {"enabled": True, "auto_cast": True}, "flops_profiler": {"output_file": "x.txt"},
     "zero_optimization": {"stage": 3, "overlap_comm": False, "offload_optimizer": {"device": "cpu"},
                           "offload_param": {"device": "cpu"}, "stage3_prefetch_bucket_size": 1000}},
])
def test_each_read_answers_the_value_at_its_path(raw: dict[str, Any]) -> None:
    """On validated configs, each accessor returns the value at its path, of its declared type."""
    holder = GeneratedAccessors()
    holder._config = load_config(raw, dp_world_size=2)
    names = {"Optional": Optional, "OffloadOptimizerConfig": OffloadOptimizerConfig,
             "OffloadParamConfig": OffloadParamConfig}
    for name, (path, returns) in CONFIG_READS.items():
        expected = functools.reduce(getattr, path.split("."), holder._config)
        got = getattr(holder, name)()
        assert got == expected, name
        declared = eval(returns, names, {})  # noqa: S307
        allowed = tuple(a for a in typing.get_args(declared)) or (declared,)
        assert isinstance(got, allowed) or (float in allowed and isinstance(got, int)), (name, got, returns)
    assert {name: getattr(holder, name)() for name in DISABLED_FEATURES} == DISABLED_FEATURES
