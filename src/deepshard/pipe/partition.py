"""Cutting a list of layers into pipeline stages (pure functions, no process group).

Every method returns stage boundaries ``parts`` (``len == stages + 1``, ``parts[0] == 0``,
``parts[-1] == len(layers)``): stage ``s`` holds layers ``parts[s]:parts[s + 1]``. No stage is ever empty.
"""
from __future__ import annotations

import re
import time
from typing import Any, Callable, Sequence

import torch


class PartitionError(ValueError):
    """Layers that cannot be cut as asked (the message gives the counts and the fix)."""


def _check(count: int, stages: int) -> None:
    if stages < 1:
        raise PartitionError(f"num_stages must be >= 1, got {stages}")
    if count < stages:
        raise PartitionError(f"{count} layer(s) cannot fill {stages} pipeline stages without an empty stage; "
                             f"use at most {count} stages or split the model into more layers")


def uniform_parts(count: int, stages: int) -> list[int]:
    """Equal layer counts; the remainder goes to the first stages."""
    _check(count, stages)
    base, extra = divmod(count, stages)
    parts = [0]
    for s in range(stages):
        parts.append(parts[-1] + base + (1 if s < extra else 0))
    return parts


def balanced_parts(weights: Sequence[float], stages: int) -> list[int]:
    """Contiguous parts minimising the heaviest stage (the slowest stage sets the pipeline's pace), each
    stage holding at least one layer; ties go to the earliest cut. Dynamic programming, O(stages * n^2)."""
    n = len(weights)
    _check(n, stages)
    prefix = [0.0]
    for w in weights:
        if w < 0:
            raise PartitionError(f"layer weights must be >= 0, got {w}")
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[s][i]: the lightest heaviest-stage for the first i layers in s stages; cut[s][i] the last cut
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i] - 1e-12:
                    best[s][i], cut[s][i] = value, j
    parts = [n]
    for s in range(stages, 0, -1):
        parts.append(cut[s][parts[-1]])
    return parts[::-1]


def type_weights(class_names: Sequence[str], pattern: str) -> list[float]:
    """1 for each layer whose class name matches ``pattern`` (case-insensitive search), else 0."""
    regex = re.compile(pattern, re.IGNORECASE)
    weights = [1.0 if regex.search(name) else 0.0 for name in class_names]
    if not any(weights):
        raise PartitionError(f"partition_method='type:{pattern}' matches none of the layer classes "
                             f"{sorted(set(class_names))}; use one of those names or another method")
    return weights


def measure_layer_costs(builders: Sequence[Callable[[], Any]], sample: Any, repeats: int = 1) -> list[float]:
    """Seconds of forward + backward of each layer, one layer built at a time on ``sample`` flowing through
    them (so the whole model is never resident). ``builders[i]()`` returns layer ``i`` as a callable."""
    costs: list[float] = []
    x = sample
    for build in builders:
        layer = build()
        best = float("inf")
        for _ in range(max(1, repeats)):
            inp = _detached(x)
            start = time.perf_counter()
            out = layer(inp)
            grads = _float_outputs(out)
            if grads:
                torch.autograd.backward(grads, [torch.ones_like(g) for g in grads])
            best = min(best, time.perf_counter() - start)
        costs.append(best)
        x = _detached(out)
        del layer
    return costs


def _detached(x: Any) -> Any:
    if torch.is_tensor(x):
        return x.detach().requires_grad_(x.is_floating_point())
    if isinstance(x, (tuple, list)):
        return type(x)(_detached(t) for t in x)
    return x


def _float_outputs(out: Any) -> list[torch.Tensor]:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if torch.is_tensor(t) and t.requires_grad]


def parts_for(method: str, count: int, stages: int, param_counts: Callable[[], list[int]],
              class_names: Callable[[], list[str]], measured: Callable[[], list[float]] | None) -> list[int]:
    """Dispatch on ``partition_method`` (case-insensitive): ``parameters`` (default), ``uniform``,
    ``type:<regex>``, ``profile`` (measured; needs a sample input)."""
    key = method.strip().lower()
    if key == "uniform":
        return uniform_parts(count, stages)
    if key == "parameters":
        return balanced_parts([float(c) for c in param_counts()], stages)
    if key.startswith("type:"):
        return balanced_parts(type_weights(class_names(), method.strip()[5:]), stages)
    if key == "profile":
        if measured is None:
            raise PartitionError("partition_method='profile' times each layer's forward and backward: pass "
                                 "partition_sample=<an input of the first layer> to PipelineModule")
        return balanced_parts(measured(), stages)
    raise PartitionError(f"partition_method={method!r} is not known; use 'parameters', 'uniform', "
                         "'type:<regex>' or 'profile'")
