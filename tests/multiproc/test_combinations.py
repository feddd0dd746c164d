"""The combination oracle: pp x tp x dp x ZeRO x precision x accumulation x offload x model (and expert
parallelism in cells of its own), with clipping
active (``combinations.py`` picks the cells; ``scenarios_combinations.py`` runs them, one spawned world per
world size). A valid cell matches single-process PyTorch (losses, the engine's global gradient norm, the
parameters), resumes from its checkpoint on another grid with the reference's next step, and its
``save_16bit_model`` file and ``zero_to_fp32`` state dict load into the plain model with the reference's
weights. A refused cell is refused by ``initialize`` with its reason."""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from tests.multiproc.combinations import (AXES, MOE_BF16_TOLERANCE, ZEROPP_TOLERANCE, Cell, allowed, cells,
                                          known_failure, markdown_table, refusal_substrings)
from tests.multiproc.harness import run_world

TOLERANCE = {"fp32": 2e-5, "bf16": 3e-2, "fp16": 5e-3}
"""Relative error allowed against the fp32 reference: fp32 to round-off; 16-bit training with fp32 master
weights within its precision (bf16 has 8 significant bits, fp16 11)."""


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: Any) -> dict[str, dict[str, Any]]:
    """Every cell's result: one world per world size, all of its cells one after another."""
    results: dict[str, dict[str, Any]] = {}
    for world in sorted({c.world for c in cells()}):
        per_rank = run_world(_matrix_world, world, str(tmp_path_factory.mktemp(f"world{world}")), timeout=600)
        for cell_id, result in per_rank[0].items():
            errors = [r[cell_id]["error"] for r in per_rank if "error" in r[cell_id]]
            results[cell_id] = {"error": errors[0]} if errors else result
    return results


def _matrix_world(rank: int, world: int, directory: str) -> dict[str, Any]:
    from tests.multiproc.scenarios_combinations import matrix_world

    return matrix_world(rank, world, directory)


def _params() -> list[Any]:
    out = []
    for cell in cells():
        reason = known_failure(cell)  # a known bug; strict: the cell must start passing once it is fixed
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(cell, id=cell.id, marks=marks))
    return out


@pytest.mark.parametrize("cell", _params())
def test_cell(matrix: dict[str, dict[str, Any]], cell: Cell) -> None:
    result = matrix[cell.id]
    where = f" [a bug lived here: {cell.why}]" if cell.why else ""
    assert "error" not in result, f"{result.get('error')}{where}"
    expected = refusal_substrings(cell)
    if expected:
        assert result["refused"] is not None, f"{cell.id} should be refused ({expected}) but trained"
        for text in expected:
            assert text in result["refused"], result["refused"]
        return
    assert result["refused"] is None, f"{cell.id} was refused: {result['refused']}"
    tol = max(TOLERANCE[cell.precision], ZEROPP_TOLERANCE if cell.zeropp == "zeropp" else 0.0,
              MOE_BF16_TOLERANCE if cell.model == "moe" and cell.precision == "bf16" else 0.0)
    for key in ("loss", "norm", "params", "w16", "w32", "resume_loss", "resume_norm", "resume_params"):
        value = result.get(key, result.get("resume"))
        assert isinstance(value, float), f"{key}: {value}{where}"
        assert value <= tol, f"{key}: relative error {value:.3g} > {tol} ({result}){where}"


def test_stage3_cells_coalesce_by_default_and_resume_per_module(matrix: dict[str, dict[str, Any]]) -> None:
    """Every valid stage-3 cell trained with its small blocks gathered as one group each (the default
    ``stage3_min_gather_size``; not with ZeRO++'s quantized blocks, which it leaves per module) and its
    checkpoint resumed with one group per module (``test_cell`` checks the values of both)."""
    trained = [c for c in cells() if c.zero == 3 and not refusal_substrings(c) and not known_failure(c)]
    assert trained
    for cell in trained:
        units = matrix[cell.id].get("units")
        assert units is not None and (units == 0) == (cell.zeropp == "zeropp"), (cell.id, matrix[cell.id])
        assert matrix[cell.id].get("resumed_units", 0) == 0, (cell.id, matrix[cell.id])


def test_pipeline_module_has_its_grid(matrix: dict[str, dict[str, Any]]) -> None:
    """A pipeline model's ``mpu()`` is its grid, before ``initialize`` and after it (DeepSpeed's pipeline
    scripts build their sampler from ``net.mpu().get_data_parallel_rank()``)."""
    checked = [r["mpu"] for r in matrix.values() if "mpu" in r]
    assert checked and all(checked)


def test_a_refused_cell_leaves_nothing_built(matrix: dict[str, dict[str, Any]]) -> None:
    """A refusal comes before anything is built: the user's model keeps its parameters (names, shapes,
    dtypes, values) and no offload directory was created."""
    refused = [c for c in cells() if refusal_substrings(c)]
    assert refused
    touched = [c.id for c in refused if not matrix[c.id].get("untouched")]
    assert not touched, f"refused only after building: {touched}"


def test_every_pair_of_axis_values_meets_in_a_valid_cell_or_is_refused() -> None:
    valid = [c for c in cells() if not refusal_substrings(c)]
    for (a, xs), (b, ys) in itertools.combinations(AXES.items(), 2):
        for x, y in itertools.product(xs, ys):
            if allowed({a: x, b: y}):
                assert any(getattr(c, a) == x and getattr(c, b) == y for c in valid), (a, x, b, y)
            else:
                assert any(getattr(c, a) == x and getattr(c, b) == y for c in cells()), (a, x, b, y)


def test_clipping_is_active_in_the_reference() -> None:
    from tests.multiproc.scenarios_combinations import CLIP, reference, reference_kind

    for kind, rows in sorted({(reference_kind(c.model), c.dp * c.gas) for c in cells()}):
        assert min(reference(kind, rows)["norms"]) > CLIP, (kind, rows)


def test_docs_table_is_generated_from_the_matrix() -> None:
    docs = Path(__file__).resolve().parents[2] / "docs" / "parallelism.md"
    assert markdown_table() in docs.read_text(), "run `python -m tests.multiproc.combinations` to update the table"
