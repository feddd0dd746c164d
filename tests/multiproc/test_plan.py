"""``deepshard plan`` against real runs on 2 gloo processes: its predicted peak (a dry run with at most
``Space.max_micro_steps`` micro-batches per step, all of them for a pipeline) within 10% of the peak a real run of the full global batch
measures, for a few choices of examples/plan_model.py; and the pick for a budget that rules some choices out,
run for real, stays within that budget. One dry-run process and one real world of 2 processes serve both
tests. ``benchmarks/plan_check.py`` checks 24 choices the same way."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest

from tests.multiproc.harness import run_world

ROOT = Path(__file__).resolve().parents[2]
MODEL, CONFIG = str(ROOT / "examples" / "plan_model.py"), ROOT / "examples" / "plan_config.json"
WORLD = 2
CHOICES = [(1, 1, 1, "none", False, 4), (1, 1, 3, "none", True, 2), (1, 2, 1, "none", False, 4)]


def _base() -> dict[str, Any]:
    return {**json.loads(CONFIG.read_text()), "train_batch_size": 16}


def _real(rank: int, world: int, rows: list[tuple]) -> list[int]:
    from deepshard.dryrun.plan_model import load_model_file, training
    from deepshard.dryrun.plan_space import Choice, Space, config_for
    from deepshard.dryrun.runner import measure

    os.environ["DEEPSHARD_SHM"] = "0"  # the transport a dry run imitates
    model, space = load_model_file(MODEL), Space(world, _base()["train_batch_size"])
    return [measure(training(model, Choice(*row), config_for(_base(), Choice(*row), space), 2), max_steps=0).peak_bytes
            for row in rows]


def _plan() -> tuple[list[int], Any, int]:
    """In a fresh single-threaded process (a fake world): the planner's predictions for CHOICES, and its search
    for a budget halfway between the smallest and the largest peak of its space (every choice dry-run once)."""
    import torch

    from deepshard.dryrun.plan_model import load_model_file
    from deepshard.dryrun.plan_space import Choice, Space
    from deepshard.dryrun.planner import _measure, search

    torch.set_num_threads(1)  # as the real world's processes run (and much faster on a shared machine)
    model, base = load_model_file(MODEL), _base()
    full = Space(WORLD, base["train_batch_size"])
    predicted = [_measure(model, Choice(*row), base, full, 2).peak_bytes for row in CHOICES]
    space = Space(WORLD, base["train_batch_size"], stages=(1, 2), micros=(2, 8), tps=(1,), pps=(1,),
                  offloads=("none",), checkpointing=(False,))
    seen: dict[Any, Any] = {}

    def remembered(choice: Any) -> Any:
        if choice not in seen:
            seen[choice] = _measure(model, choice, base, space, 2)
        return seen[choice]

    roomy = search(model, base, space, 2**40, measure=remembered)
    peaks = sorted(t.peak_bytes for t in roomy.trials if t.peak_bytes)
    if len(peaks) < 2 or peaks[0] == peaks[-1]:
        raise RuntimeError(f"the test space should give different peaks; got {peaks}")
    budget = (peaks[0] + peaks[-1]) // 2
    return predicted, search(model, base, space, budget, measure=remembered), budget


@pytest.fixture(scope="module")
def planned() -> tuple[list[int], Any, int, list[int]]:
    """The predictions, the plan, its budget, and each rank's real peaks of CHOICES and the pick (one world)."""
    with mp.get_context("spawn").Pool(1) as pool:
        predicted, plan, budget = pool.apply(_plan)
    rows = list(CHOICES)
    if plan.pick is not None:
        c = plan.pick.choice
        rows.append((c.tp, c.pp, c.stage, c.offload, c.checkpointing, c.micro))
    real = run_world(_real, WORLD, rows, timeout=900)
    return predicted, plan, budget, [max(r[i] for r in real) for i in range(len(rows))]


def test_predicted_peaks_within_ten_percent_of_real_runs(planned: tuple) -> None:
    predicted, _, _, measured = planned
    for i, row in enumerate(CHOICES):
        assert abs(predicted[i] - measured[i]) <= 0.1 * measured[i], (row, predicted[i], measured[i])


def test_the_pick_fits_its_budget_when_run_for_real(planned: tuple) -> None:
    _, plan, budget, measured = planned
    assert plan.pick is not None and plan.pick.peak_bytes <= budget, plan.trials
    assert any(not t.fits and t.peak_bytes for t in plan.trials), "the budget should rule some choice out"
    assert measured[len(CHOICES)] <= budget, (plan.pick, measured[len(CHOICES)], budget)
