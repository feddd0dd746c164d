"""A DeepSpeed-style pipeline script (examples/train_pipeline.py: PipelineModule of LayerSpecs,
train_batch() in a loop over a RepeatingLoader, ``import deepshard as deepspeed``) under the launcher on
2 processes (2 stages): it runs unchanged and the loss falls."""
from __future__ import annotations

import re
import subprocess
import sys

from tests.e2e.test_launcher import ROOT, _clean_env, _free_port


def test_pipeline_script_trains_two_stages_under_the_launcher() -> None:
    cmd = [sys.executable, "-m", "deepshard.launcher.cli", "--master_port", str(_free_port()), "--num_gpus", "2",
           "examples/train_pipeline.py", "--steps", "8"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = re.search(r"stage 0: loss ([\d.]+) -> ([\d.]+) after 8 steps \(first stage True, last stage False\)",
                      proc.stdout + proc.stderr)
    assert found, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert float(found.group(2)) < 0.5 * float(found.group(1))
