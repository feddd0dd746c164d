"""``python -m deepshard.compat.standin on|off|status``: the ``.pth`` hook that makes ``import deepspeed``
deepshard in every process of an environment with no real DeepSpeed (what ``accelerate launch`` needs),
and that steps aside for a real one. Each check runs a fresh interpreter whose site directory is a
temporary one holding the ``.pth`` (a ``sitecustomize`` on ``PYTHONPATH`` adds it as site-packages would)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from deepshard.compat import standin

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys, importlib.util, importlib.metadata
at_start = sorted(m for m in ("deepshard", "torch") if m in sys.modules)
spec = importlib.util.find_spec("deepspeed")
version = importlib.metadata.version("deepspeed")
import deepspeed
who = getattr(deepspeed, "WHO", "deepshard" if "deepshard" in sys.modules else "?")
if who == "deepshard":
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    assert deepspeed.initialize is sys.modules["deepshard"].initialize
else:
    assert importlib.util.find_spec("deepspeed.runtime") is None  # the real one's, not filled in by deepshard
print(at_start, version, who)
"""


def _site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site)!r})\n")
    return site


def _probe(site: Path, *extra_path: Path, **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(site), *map(str, extra_path), str(ROOT / "src")])
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DEEPSHARD_STANDIN")}
    full.update(PYTHONPATH=path, **env)
    return subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=300)


def test_on_makes_deepspeed_deepshard_without_importing_it_at_start_up(tmp_path: Path) -> None:
    site = _site(tmp_path)
    assert "wrote" in standin.turn_on(site) and (site / standin.PTH_NAME).exists()
    done = _probe(site)
    assert done.returncode == 0, done.stderr[-3000:]
    # nothing of deepshard (or torch) at start-up; the version is the stand-in's; the names are deepshard's
    assert done.stdout.split("\n")[0] == "[] 0.19.8+deepshard.0.1.0 deepshard", done.stdout
    assert "'import deepspeed' is deepshard" in standin.status(site)


def test_a_real_deepspeed_wins_and_off_removes_the_hook(tmp_path: Path) -> None:
    site = _site(tmp_path)
    standin.turn_on(site)
    real = tmp_path / "real"
    (real / "deepspeed").mkdir(parents=True)
    (real / "deepspeed" / "__init__.py").write_text("WHO = 'real'\n")
    (real / "deepspeed-0.19.8.dist-info").mkdir()
    (real / "deepspeed-0.19.8.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\n"
                                                                  "Version: 0.19.8\n")
    done = _probe(site, real)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("[] 0.19.8 real"), done.stdout  # never shadowed
    assert "removed" in standin.turn_off(site) and not (site / standin.PTH_NAME).exists()
    done = _probe(site)
    assert done.returncode != 0 and "No package metadata was found for deepspeed" in done.stderr  # nothing
    assert "nothing to remove" in standin.turn_off(site)


def test_it_can_be_turned_off_for_one_process(tmp_path: Path) -> None:
    site = _site(tmp_path)
    standin.turn_on(site)
    done = _probe(site, DEEPSHARD_STANDIN="0")
    assert done.returncode != 0 and "No package metadata was found for deepspeed" in done.stderr
