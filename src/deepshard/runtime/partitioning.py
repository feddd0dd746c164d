"""``deepspeed.runtime.utils.partition_uniform`` / ``partition_balanced``: cut a sequence of items (pipeline
layers) into contiguous parts, returned as ``num_parts + 1`` boundaries (part ``p`` is
``items[parts[p]:parts[p + 1]]``). With no more items than parts, each item gets a part of its own and the
last parts are empty, as DeepSpeed does."""
from __future__ import annotations

from typing import Sequence

__all__ = ["partition_balanced", "partition_uniform", "prefix_sum_inc"]


def prefix_sum_inc(weights: Sequence[float]) -> list[float]:
    """Inclusive prefix sums: ``[3, 4, 5]`` -> ``[3, 7, 12]``."""
    sums: list[float] = []
    for w in weights:
        sums.append(w + (sums[-1] if sums else 0))
    return sums


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Equal item counts; the first ``num_items % num_parts`` parts take one more."""
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    base, extra = divmod(num_items, num_parts)
    parts = [0]
    for p in range(num_parts):
        parts.append(parts[-1] + base + (1 if p < extra else 0))
    return parts


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous, non-empty parts whose heaviest part is as light as possible and, among those, whose
    lightest part is as heavy as possible (the spread between stages is what stalls a pipeline). Dynamic
    programming over (parts, prefix) keeping the best (heaviest, lightest) pair, O(num_parts * n^2)."""
    n = len(weights)
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    prefix = [0.0] + [float(s) for s in prefix_sum_inc(weights)]
    worst = (float("inf"), float("-inf"))
    best = [[worst] * (n + 1) for _ in range(num_parts + 1)]  # best[j][i]: (max, -min) of i items in j parts
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = (0.0, float("-inf"))
    for j in range(1, num_parts + 1):
        for i in range(j, n - (num_parts - j) + 1):
            for k in range(j - 1, i):
                if best[j - 1][k] == worst:
                    continue
                last = prefix[i] - prefix[k]
                heaviest, neg_lightest = best[j - 1][k]
                lightest = last if j == 1 else min(-neg_lightest, last)
                candidate = (max(heaviest, last), -lightest)
                if candidate < best[j][i]:
                    best[j][i], cut[j][i] = candidate, k
    parts = [n]
    for j in range(num_parts, 0, -1):
        parts.append(cut[j][parts[-1]])
    return parts[::-1]
