"""``deepshard plan`` against real runs on 2 gloo processes: its predicted peak (a dry run with at most
``Space.max_micro_steps`` micro-batches per step) within 10% of the peak a real run of the full global batch
measures, for a few choices of examples/plan_model.py; and the pick for a tight budget, run for real, stays
within that budget. ``benchmarks/plan_check.py`` checks 24 choices the same way."""
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
CHOICES = [(1, 1, 1, "none", False, 4), (1, 1, 3, "none", True, 2), (2, 1, 2, "none", False, 2),
           (1, 2, 1, "none", False, 4)]
BUDGET = 9 * 2**20


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


def _plan() -> tuple[list[int], Any]:
    """The planner's predictions for CHOICES and its search for BUDGET (in a fresh process: a fake world)."""
    from deepshard.dryrun.plan_model import load_model_file
    from deepshard.dryrun.plan_space import Choice, Space
    from deepshard.dryrun.planner import _measure, search

    model = load_model_file(MODEL)
    space = Space(WORLD, _base()["train_batch_size"], stages=(1, 2), micros=(2, 4, 8), tps=(1,), pps=(1,),
                  offloads=("none",), checkpointing=(False,))
    predicted = [_measure(model, Choice(*row), _base(), Space(WORLD, _base()["train_batch_size"]), 2).peak_bytes
                 for row in CHOICES]
    plan = search(model, _base(), space, BUDGET)
    return predicted, plan


@pytest.fixture(scope="module")
def planned() -> tuple[list[int], Any]:
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(_plan)


def test_predicted_peaks_within_ten_percent_of_real_runs(planned: tuple[list[int], Any]) -> None:
    predicted, _ = planned
    real = run_world(_real, WORLD, CHOICES, timeout=900)
    for i, row in enumerate(CHOICES):
        measured = max(r[i] for r in real)
        assert abs(predicted[i] - measured) <= 0.1 * measured, (row, predicted[i], measured)


def test_the_pick_fits_its_budget_when_run_for_real(planned: tuple[list[int], Any]) -> None:
    _, plan = planned
    assert plan.pick is not None and plan.pick.peak_bytes <= BUDGET
    assert any(not t.fits and t.peak_bytes for t in plan.trials), "the budget should rule some choice out"
    c = plan.pick.choice
    real = run_world(_real, WORLD, [(c.tp, c.pp, c.stage, c.offload, c.checkpointing, c.micro)], timeout=900)
    assert max(r[0] for r in real) <= BUDGET
