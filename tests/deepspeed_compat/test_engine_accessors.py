"""deepshard's engine answers DeepSpeed 0.19.8's config accessor methods as DeepSpeed does, for four configs.

Both sides run ``accessor_worker.py`` in a subprocess (DeepSpeed in its own venv, ``make deepspeed-venv``; skipped
with the reason when it is absent) and print every accessor's value; the values must be equal (same JSON type
and value; config objects and dicts compared on the keys both have), except the differences listed below.
A case in a half-precision type DeepSpeed refuses on this CPU (fp16 without mkldnn fp16 kernels) is skipped
saying so; the other cases still run (``ds_support.refused_dtypes``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.deepspeed_compat.accessor_worker import ACCESSORS, CASES, PROPERTIES, case_config
from tests.deepspeed_compat.ds_support import HALF_DTYPES, REPO, refused_dtypes, require_deepspeed, run_in_deepspeed

WORKER = Path(__file__).with_name("accessor_worker.py")

# deliberate differences, every case: name -> why
DIFFERENT = {
    "get_batch_info": "DeepSpeed 0.19.8 returns the three bound methods, not their values; deepshard the ints",
    "get_data_parallel_rank": "DeepSpeed asserts unless its model-parallel groups were set up; deepshard: 0",
    "get_model_parallel_rank": "as get_data_parallel_rank",
    "get_tensor_parallel_rank": "as get_data_parallel_rank",
    "compile_zero_optimization_stage": "DeepSpeed raises TypeError without compile passes; deepshard: False",
    "tensor_parallel_config": "DeepSpeed's TPConfig object vs deepshard's AutoTPConfig (autotp_size() agrees)",
}
# deliberate differences of defaults: compared only in the case whose config sets the key
DEFAULTS_DIFFER = {
    "zero_max_reuse_distance": "deepshard's default is 0 (keep nothing gathered), DeepSpeed's 1e9",
    "zero_prefetch_bucket_size": "deepshard's default is None (the largest parameter group), DeepSpeed's 5e7",
}
SETS_STAGE3_KEYS = "zero3_offload_param"


def _run(library: str, cases: list[str]) -> dict[str, Any]:
    """Every case's answers under ``library`` (one process builds the engines)."""
    args = [str(WORKER), "--library", library, "--case", *cases]
    if library == "deepspeed":
        out = run_in_deepspeed(args, "accessor_worker.py", timeout=300)
    else:
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise AssertionError(f"{library} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        out = proc.stdout
    return json.loads(out.strip().splitlines()[-1])


def half_dtype(case: str) -> str | None:
    """The half-precision type ``case``'s config enables (fp16 / bf16), or None."""
    config, _ = case_config(case)
    return next((dtype for dtype in HALF_DTYPES if (config.get(dtype) or {}).get("enabled")), None)


@pytest.fixture(scope="module")
def answers() -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """(DeepSpeed's, deepshard's) answers per case, and ``{case: why}`` for the cases DeepSpeed refuses here."""
    python = require_deepspeed()
    refused = refused_dtypes(str(python))
    skipped = {case: refused[dtype] for case in CASES if (dtype := half_dtype(case)) in refused}
    cases = [case for case in CASES if case not in skipped]
    if not cases:
        return {}, {}, skipped
    return _run("deepspeed", cases), _run("deepshard", cases), skipped


def _unwrap(value: Any) -> Any:
    return value["__object__"] if isinstance(value, dict) and "__object__" in value else value


def _mismatches(name: str, ds: Any, ours: Any) -> list[str]:
    ds, ours = _unwrap(ds), _unwrap(ours)
    if isinstance(ds, dict) and isinstance(ours, dict):
        common = set(ds) & set(ours)
        if not common:
            return [f"{name}: no key in common ({sorted(ds)} vs {sorted(ours)})"]
        return [m for key in sorted(common) for m in _mismatches(f"{name}.{key}", ds[key], ours[key])]
    if ds != ours or type(ds) is not type(ours):
        return [f"{name}: DeepSpeed {ds!r} ({type(ds).__name__}), deepshard {ours!r} ({type(ours).__name__})"]
    return []


@pytest.mark.parametrize("case", CASES)
def test_accessors_equal_deepspeeds(answers: tuple[dict[str, Any], dict[str, Any], dict[str, str]],
                                    case: str) -> None:
    if case in answers[2]:
        pytest.skip(f"{answers[2][case]}: case {case} not compared")
    ds, ours = answers[0][case], answers[1][case]
    errors = [name for name, value in ours.items() if isinstance(value, dict) and "__error__" in value]
    assert not errors, f"deepshard's engine failed to answer {errors}"
    assert set(ours) == set(ds) == set(ACCESSORS + PROPERTIES)
    skip = set(DIFFERENT) | (set() if case == SETS_STAGE3_KEYS else set(DEFAULTS_DIFFER))
    problems = [m for name in ds if name not in skip for m in _mismatches(name, ds[name], ours[name])]
    assert not problems, "\n".join(problems)
    assert ours["get_batch_info"] == [ours["train_batch_size"], ours["train_micro_batch_size_per_gpu"],
                                      ours["gradient_accumulation_steps"]]
