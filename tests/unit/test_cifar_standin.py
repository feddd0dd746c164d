"""The stand-in ``torchvision`` that runs DeepSpeed's CIFAR-10 tutorial offline
(``benchmarks/tutorials/standin``) and the loss parsing of its runner (``run_cifar.py``).

The stand-in is imported in a child interpreter so this process's ``sys.modules`` never holds a
``torchvision`` (libraries probe for the real one)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tutorials.run_cifar import compare, parse_losses, Run  # noqa: E402

CHILD = r"""
import json, torch, torchvision
from torchvision import datasets, transforms
t = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
a = datasets.CIFAR10(root="./nowhere", train=True, download=True, transform=t)
w1 = torch.rand(3)
b = datasets.CIFAR10(root="./nowhere", train=True, download=True, transform=t)
w2 = torch.rand(3)
test = datasets.CIFAR10(train=False, transform=t)
import os
os.environ["CIFAR_STANDIN_TORCH_SEED"] = "7"
c = datasets.CIFAR10(train=True, transform=t)
w3 = torch.rand(3)
torch.manual_seed(7)
w4 = torch.rand(3)
x, y = a[5]
raw = a.data[5]
manual = (raw.permute(2, 0, 1).float() / 255 - 0.5) / 0.5
print(json.dumps({
    "len": len(a), "test_len": len(test), "shape": list(x.shape), "dtype": str(x.dtype),
    "label_type": type(y).__name__, "same_data": bool(torch.equal(a.data, b.data)), "same_seed": bool(torch.equal(w1, w2)),
    "test_differs": bool(not torch.equal(a.data[:len(test)], test.data)),
    "torch_seed_alone": bool(torch.equal(a.data, c.data) and torch.equal(w3, w4) and not torch.equal(w1, w3)), "manual": bool(torch.equal(x, manual)),
    "range": [float(x.min()), float(x.max())], "classes": sorted(set(a.targets)), "module": torchvision.__file__}))
"""


def test_standin_dataset_and_transforms() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "benchmarks" / "tutorials" / "standin"),
               CIFAR_STANDIN_TRAIN_SIZE="64", CIFAR_STANDIN_TEST_SIZE="16", CIFAR_STANDIN_SEED="3")
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "standin" in got["module"]
    assert (got["len"], got["test_len"]) == (64, 16)
    assert got["shape"] == [3, 32, 32] and got["dtype"] == "torch.float32" and got["label_type"] == "int"
    assert got["same_data"] and got["same_seed"] and got["test_differs"] and got["manual"]
    assert got["torch_seed_alone"]  # CIFAR_STANDIN_TORCH_SEED moves torch's generator, not the data
    assert -1.0 <= got["range"][0] < got["range"][1] <= 1.0
    assert got["classes"] == list(range(10))


def test_runner_parses_and_compares_losses() -> None:
    printed = "noise\n[ 1,     1] loss:  2.290\n[ 1,     2] loss:  2.270\nFinished Training\n[ 2,    10] loss:  nan\n"
    losses = parse_losses(printed)
    assert losses[:2] == [2.29, 2.27] and len(losses) == 3 and losses[2] != losses[2]
    a, b = Run("x", 0, "fp32", [2.29, 2.27, 2.2]), Run("y", 3, "fp32", [2.29, 2.28, 2.0])
    worst, first = compare(a, b)
    assert first == 2 and abs(worst - 0.2) < 1e-9
    assert compare(a, a) == (0.0, None)
