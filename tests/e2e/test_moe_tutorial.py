"""DeepSpeed's CIFAR-10 tutorial with ``--moe``, unchanged, on 2 processes under deepshard (the short version
of ``benchmarks/tutorials/run_moe_cifar.py``): 20 steps must print DeepSpeed 0.19.8's losses exactly (the gate's
random draws and the layer's arithmetic are DeepSpeed's; the runs part only later, through round-off from
elsewhere: docs/moe.md). The tutorial is DeepSpeedExamples' file, not part of this repository: the test
looks for it at ``$DEEPSHARD_CIFAR_TUTORIAL`` (default: the checkout of DeepSpeedExamples beside this
project) and skips without it."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(os.environ.get("DEEPSHARD_CIFAR_TUTORIAL",
                             "/work/ext/DeepSpeedExamples/training/cifar/cifar10_deepspeed.py"))

# DeepSpeed 0.19.8's printed losses, 20 steps of the runner's synthetic data (DS_ACCELERATOR=cpu, 2 processes);
# the ZeRO-3 case is DeepSpeed's ZeRO-2 run of the same flags (DeepSpeed refuses native MoE under ZeRO-3)
DEEPSPEED = {
    "e4_ep2_k1_rs_pg_z2": [2.282, 2.28, 2.308, 2.302, 2.32, 2.289, 2.311, 2.32, 2.29, 2.328, 2.277, 2.295, 2.275,
                           2.315, 2.275, 2.312, 2.325, 2.312, 2.299, 2.306],
    "e2_ep2_k1_z3": [2.307, 2.275, 2.293, 2.292, 2.319, 2.299, 2.278, 2.315, 2.295, 2.299, 2.281, 2.345, 2.304,
                     2.304, 2.275, 2.293, 2.31, 2.311, 2.338, 2.293],
}


def test_tutorial_with_moe_prints_deepspeeds_losses(tmp_path: Path) -> None:
    if not SCRIPT.is_file():
        pytest.skip(f"DeepSpeed's CIFAR-10 tutorial is not at {SCRIPT}: point DEEPSHARD_CIFAR_TUTORIAL at "
                    "DeepSpeedExamples' training/cifar/cifar10_deepspeed.py")
    sys.path.insert(0, str(ROOT))
    from benchmarks.tutorials.run_moe_cifar import main

    out = tmp_path / "runs.json"
    rc = main([str(SCRIPT), "--library", "deepshard", "--cases", *DEEPSPEED, "--steps", "20", "--test-size", "40",
               "--json", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert rc == 0
    for case, expected in DEEPSPEED.items():
        assert runs[case]["deepshard"]["losses"] == expected, case
