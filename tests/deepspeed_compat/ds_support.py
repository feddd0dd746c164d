"""Where the real DeepSpeed 0.19.8 is, and which half-precision types it accepts on this CPU.

DeepSpeed's CPU accelerator refuses ``fp16`` at ``initialize`` (``ValueError: Type fp16 is not supported on
your device``) unless torch's mkldnn has fp16 kernels for this CPU (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``:
AVX512-FP16 / AMX-FP16); ``bf16`` it accepts everywhere today. The tests that build real DeepSpeed engines ask
:func:`refused_dtypes` once and skip only the cases in a refused dtype, saying why, so that a refusal never
errors the cases beside it.

``DEEPSHARD_TEST_DEEPSPEED_REFUSES=fp16,bf16`` (any subset) makes the probe report those dtypes as refused,
so the skip paths can be exercised on a CPU that has the kernels.

Every DeepSpeed process the tests start goes through :func:`run_in_deepspeed`: its CPU accelerator, one OpenMP
thread, this checkout on ``PYTHONPATH`` after ``ds_boot/`` (whose ``sitecustomize`` stops DeepSpeed's C++ op
builds), ``TORCH_EXTENSIONS_DIR`` inside DeepSpeed's venv unless set (so that a build, if one is ever allowed,
is never shared with another venv's), and a time limit after which the process and every process it started
are killed and the test fails saying what hung.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DS_VENV = REPO / ".venv-deepspeed"
DS_PYTHON = Path(os.environ.get("DEEPSHARD_DEEPSPEED_PYTHON", DS_VENV / "bin" / "python"))
DS_READY = "DEEPSHARD_DEEPSPEED_PYTHON" in os.environ or (DS_VENV / ".installed").exists()
DS_BOOT = Path(__file__).with_name("ds_boot")  # its sitecustomize: no C++ op builds
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


def extensions_dir() -> Path:
    """Where DeepSpeed's venv keeps JIT-built ops: ``TORCH_EXTENSIONS_DIR`` if set, else a folder inside the venv
    (the default ``~/.cache/torch_extensions`` is shared by every venv, which rebuild each other's ops)."""
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(given) if given else DS_PYTHON.parent.parent / "torch_extensions"


def deepspeed_env() -> dict[str, str]:
    """The environment of a DeepSpeed process started by the tests (see the module docstring)."""
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(DS_BOOT), str(REPO)]), "TORCH_EXTENSIONS_DIR": str(extensions_dir())}


def _leftover_locks() -> str:
    locks = sorted(extensions_dir().glob("*/*/lock"))
    return (f" Build locks present (a build killed halfway leaves one, and DeepSpeed then waits forever): "
            f"{', '.join(map(str, locks))}; delete them if no build runs." if locks else "")


def run_in_deepspeed(args: list[str], what: str, timeout: float = 300.0, python: str | None = None) -> str:
    """``args`` run by DeepSpeed's python (``[script, ...]`` or ``["-c", code]``); its stdout.

    A failure raises with the process's output; a run past ``timeout`` seconds is killed with every process it
    started (its ranks) and raises naming ``what`` hung, never waiting longer."""
    python = python or str(require_deepspeed())
    with subprocess.Popen([python, *args], env=deepspeed_env(), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"{what} under DeepSpeed ({python}) did not finish within {timeout:.0f} s and was "
                                 f"killed.{_leftover_locks()}\nits stderr:\n{err[-4000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"{what} under DeepSpeed ({python}) failed ({proc.returncode}):\n{out[-2000:]}\n"
                             f"{err[-6000:]}")
    return out


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
    out = run_in_deepspeed(["-c", _PROBE], "asking which of fp16 and bf16 DeepSpeed supports", timeout=120,
                           python=python)
    supported = json.loads(out.strip().splitlines()[-1])
    refused = {}
    for dtype in HALF_DTYPES:
        if not supported[dtype]:
            kernels = "mkldnn fp16 kernels (AVX512-FP16 / AMX-FP16)" if dtype == "fp16" else "bf16 support"
            refused[dtype] = (f"DeepSpeed 0.19.8 refuses {dtype} on this CPU (its CPU accelerator finds no "
                              f"{kernels}: 'Type {dtype} is not supported on your device')")
    for dtype in simulated_refusals() - set(refused):
        refused[dtype] = f"DeepSpeed's refusal of {dtype} is simulated ({SIMULATE_ENV})"
    return refused
