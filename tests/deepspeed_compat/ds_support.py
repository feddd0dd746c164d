"""Where the real DeepSpeed 0.19.8 is, and which half-precision types it accepts on this CPU.

DeepSpeed's CPU accelerator refuses ``fp16`` at ``initialize`` (``ValueError: Type fp16 is not supported on
your device``) unless torch's mkldnn has fp16 kernels for this CPU (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``:
AVX512-FP16 / AMX-FP16); ``bf16`` it accepts everywhere today. The tests that build real DeepSpeed engines ask
:func:`refused_dtypes` once and skip only the cases in a refused dtype, saying why, so that a refusal never
errors the cases beside it.

``DEEPSHARD_TEST_DEEPSPEED_REFUSES=fp16,bf16`` (any subset) makes the probe report those dtypes as refused,
so the skip paths can be exercised on a CPU that has the kernels.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DS_VENV = REPO / ".venv-deepspeed"
DS_PYTHON = Path(os.environ.get("DEEPSHARD_DEEPSPEED_PYTHON", DS_VENV / "bin" / "python"))
DS_READY = "DEEPSHARD_DEEPSPEED_PYTHON" in os.environ or (DS_VENV / ".installed").exists()
SIMULATE_ENV = "DEEPSHARD_TEST_DEEPSPEED_REFUSES"
HALF_DTYPES = ("fp16", "bf16")

# run in DeepSpeed's venv: its own accelerator's answers (the checks its engine makes at initialize)
_PROBE = ("import json; from deepspeed.accelerator import get_accelerator; a = get_accelerator(); "
          "print(json.dumps({'fp16': bool(a.is_fp16_supported()), 'bf16': bool(a.is_bf16_supported())}))")


def require_deepspeed() -> Path:
    """The python of DeepSpeed's venv, or skip saying how to build it."""
    if not (DS_READY and DS_PYTHON.exists()):
        failed = DS_VENV / ".failed"
        why = f" ({failed.read_text().strip()})" if failed.exists() else ""
        pytest.skip(f"DeepSpeed 0.19.8 is not installed at {DS_PYTHON}{why}: build it with `make deepspeed-venv` "
                    "(needs the package index), or point DEEPSHARD_DEEPSPEED_PYTHON at a python that has it")
    return DS_PYTHON


def simulated_refusals(environ: dict[str, str] | None = None) -> set[str]:
    """The dtypes ``DEEPSHARD_TEST_DEEPSPEED_REFUSES`` names; a name other than fp16/bf16 is an error."""
    raw = (os.environ if environ is None else environ).get(SIMULATE_ENV, "")
    names = {name.strip().lower() for name in raw.split(",") if name.strip()}
    unknown = names - set(HALF_DTYPES)
    if unknown:
        raise ValueError(f"{SIMULATE_ENV}={raw!r} names {sorted(unknown)}; give a comma-separated subset of "
                         f"{', '.join(HALF_DTYPES)}")
    return names


@functools.lru_cache(maxsize=None)
def refused_dtypes(python: str) -> dict[str, str]:
    """``{dtype: why}`` for each of fp16 / bf16 that DeepSpeed in ``python``'s venv refuses on this machine
    (asked once per session; a probe that fails is an error, not a skip)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([python, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"asking DeepSpeed at {python} which dtypes it supports failed "
                           f"({proc.returncode}):\n{proc.stderr[-3000:]}")
    supported = json.loads(proc.stdout.strip().splitlines()[-1])
    out = {}
    for dtype in HALF_DTYPES:
        if not supported[dtype]:
            kernels = "mkldnn fp16 kernels (AVX512-FP16 / AMX-FP16)" if dtype == "fp16" else "bf16 support"
            out[dtype] = (f"DeepSpeed 0.19.8 refuses {dtype} on this CPU (its CPU accelerator finds no "
                          f"{kernels}: 'Type {dtype} is not supported on your device')")
    for dtype in simulated_refusals() - set(out):
        out[dtype] = f"DeepSpeed's refusal of {dtype} is simulated ({SIMULATE_ENV})"
    return out
