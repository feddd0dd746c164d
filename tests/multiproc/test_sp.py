"""Sequence parallelism on gloo against one process: attention (Ulysses, ring, hybrid; GQA, uneven heads
and lengths, causal and not), and training through the engine."""
from __future__ import annotations

from typing import Any

import pytest

from tests.multiproc.harness import run_world
from tests.multiproc.scenarios_sp import ATTENTION_CASES_SP2, ATTENTION_CASES_SP4, attention_world


@pytest.fixture(scope="module")
def attention_results() -> list[dict[Any, Any]]:
    return run_world(attention_world, 4, timeout=400)


@pytest.mark.parametrize("case", [("sp4",) + c for c in ATTENTION_CASES_SP4] + [("sp2",) + c for c in ATTENTION_CASES_SP2],
                         ids=lambda c: "-".join(str(x) for x in c))
def test_attention_equals_one_process(attention_results: list, case: tuple) -> None:
    for rank, out in enumerate(attention_results):
        errors = out[case]
        assert max(errors.values()) < 1e-10, (rank, errors)


def test_attention_traffic_is_counted_per_group(attention_results: list) -> None:
    labels = attention_results[0]["labels"]
    assert "sp:all_to_all" in labels and "sp:ring_send" in labels
    assert "sp_ulysses:all_to_all" in labels and "sp_ring:ring_send" in labels
