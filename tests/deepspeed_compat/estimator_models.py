"""The models and setups both libraries' memory estimators are printed for (imported by DeepSpeed's python
too, so no pytest here)."""
from __future__ import annotations

from typing import Callable

import torch

SETUPS = [("tied", 1, 1), ("tied", 8, 2), ("wide", 2, 1), ("wide", 4, 3)]
"""(model, num_gpus_per_node, num_nodes)"""


def tied() -> torch.nn.Module:
    """An embedding tied to the output layer: both estimators count the shared weight once."""
    emb = torch.nn.Embedding(3000, 512)
    head = torch.nn.Linear(512, 3000, bias=False)
    head.weight = emb.weight
    return torch.nn.Sequential(emb, torch.nn.Linear(512, 2048), torch.nn.Linear(2048, 512), head)


def wide() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 8192), torch.nn.Linear(8192, 10))


def print_all(stage3: Callable[..., object], stage2: Callable[..., object]) -> None:
    """Print the ZeRO-3 then the ZeRO-2 table of every setup with the given estimator functions."""
    for name, gpus, nodes in SETUPS:
        model = {"tied": tied, "wide": wide}[name]()
        stage3(model, num_gpus_per_node=gpus, num_nodes=nodes)
        stage2(model, num_gpus_per_node=gpus, num_nodes=nodes)
