"""DeepSpeed's helper functions and config classes that DeepSpeed's own unit tests import (numa ranges, pipeline
partitioning, the launcher's resource filters and hostfile parser, checkpoint file order, comms/timer/pinned
memory helpers, the fp16/ZeRO config models and enums, DeepSpeedConfig's batch arithmetic, op compatibility,
OnDevice): the same calls under DeepSpeed 0.19.8 and under deepshard give the same answers."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.deepspeed_compat.real import REPO, needs_deepspeed, run_deepspeed


def _ours() -> dict:
    code = ("import deepshard.compat, json\ndeepshard.compat.install(replace_installed=True)\n"
            "from tests.deepspeed_compat.helper_cases import run\n"
            "results = run()\nprint('====='); print(json.dumps(results, sort_keys=True, default=str))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    return _after_marker(proc.stdout)


def _after_marker(stdout: str) -> dict:
    """The JSON line printed after the ``=====`` marker (other lines are the libraries' own output)."""
    return json.loads(stdout.split("=====\n", 1)[1].splitlines()[0])


def _differences(ours: object, theirs: object, path: str = "") -> list[str]:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return [d for key in sorted(set(ours) | set(theirs))
                for d in _differences(ours.get(key), theirs.get(key), f"{path}/{key}")]
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        return [d for i, (a, b) in enumerate(zip(ours, theirs)) for d in _differences(a, b, f"{path}[{i}]")]
    return [] if ours == theirs else [f"{path}: deepshard {ours!r}, DeepSpeed {theirs!r}"]


@needs_deepspeed
def test_helpers_answer_as_deepspeeds() -> None:
    theirs = _after_marker(run_deepspeed("import runpy\nrunpy.run_module('tests.deepspeed_compat.helper_cases', "
                                         "run_name='__main__')"))
    ours = _ours()
    assert _differences(ours, theirs) == []
    assert len(ours["launcher"]) == 14 and ours["numa"]["0,2-4,6,8-9"] == [0, 2, 3, 4, 6, 8, 9]
