"""What each rank runs for the failure-path tests: failed saves, wrong or damaged checkpoints, interrupted
publications, and collectives that one rank never joins (importable by spawned processes)."""
from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import deepshard
from deepshard.checkpoint import io as ckpt_io
from tests.multiproc.models import TinyNet, make_batches, make_model, micro_slice, optimizer_config
from tests.multiproc.scenarios_stage0 import full_weights, run_steps


class TinyNetPlus(TinyNet):
    """TinyNet with one more parameter: its checkpoints hold a name TinyNet does not have."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Parameter(torch.ones(3))


class Wrapped(nn.Module):
    """TinyNet under another prefix: none of its names match TinyNet's checkpoints."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.inner(x, y)


def _config(stage: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": optimizer_config(), "zero_optimization": zero}


def _error(fn: Any) -> str:
    try:
        fn()
        return "no error"
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__}: {err}"


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _full_save_failure(engine: Any, rank: int, tmp: Path) -> dict[str, Any]:
    """Rank 1's file system fills up while it writes: every rank raises the same error; 'good' survives."""
    import safetensors.torch as st

    real = st.save_file

    def disk_full(tensors: Any, filename: str, metadata: Any = None) -> None:
        with open(filename, "wb") as f:
            f.write(b"x" * 64)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if rank == 1:
        st.save_file = disk_full
    start = time.monotonic()
    try:
        message = _error(lambda: engine.save_checkpoint(str(tmp), tag="good"))
    finally:
        st.save_file = real
    return {"message": message, "seconds": time.monotonic() - start,
            "leftovers": sorted(p.name for p in tmp.iterdir() if p.name.startswith("."))}


def checkpoint_failures(rank: int, world: int, tmp_root: str) -> dict[int, dict[str, Any]]:
    """Every check below, for ZeRO stages 2 and 3, in one world."""
    return {stage: _checkpoint_failures(rank, world, tmp_root, stage) for stage in (2, 3)}


def _checkpoint_failures(rank: int, world: int, tmp_root: str, stage: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tmp = Path(tmp_root) / f"stage{stage}"
    warnings = _Warnings()
    logging.getLogger("deepshard").addHandler(warnings)
    engine, *_ = deepshard.initialize(model=make_model(), config=_config(stage))
    run_steps(engine, make_batches(1, 2 * world), 2, 1, rank, world)
    engine.save_checkpoint(str(tmp), tag="good")
    saved = full_weights(engine)
    # a crash between the two renames of a same-tag save: the intact copy is aside, the tag is absent
    dist.barrier()
    if rank == 0:
        os.rename(tmp / "good", tmp / ".old-good-0")
        (tmp / ".tmp-crashed").mkdir()
        (tmp / ".tmp-crashed" / "zero_rank0.safetensors").write_bytes(b"partial")
    dist.barrier()
    fresh, *_ = deepshard.initialize(model=make_model(seed=5), config=_config(stage))
    out["recovered"] = _error(lambda: fresh.load_checkpoint(str(tmp)))
    out["recovered_same"] = _same(full_weights(fresh), saved)
    engine.save_checkpoint(str(tmp), tag="other")
    out["after_save"] = sorted(p.name for p in tmp.iterdir() if p.name.startswith("."))
    # names that do not match
    plus, *_ = deepshard.initialize(model=TinyNetPlus(), config=_config(stage))
    plus.save_checkpoint(str(tmp), tag="plus")
    out["unexpected_strict"] = _error(lambda: fresh.load_checkpoint(str(tmp), tag="plus"))
    warnings.messages.clear()
    out["unexpected_lenient"] = _error(lambda: fresh.load_checkpoint(str(tmp), tag="plus",
                                                                     load_module_strict=False))
    out["lenient_warnings"] = list(warnings.messages)
    wrapped, *_ = deepshard.initialize(model=Wrapped(), config=_config(stage))
    out["no_match_lenient"] = _error(lambda: wrapped.load_checkpoint(str(tmp), tag="good",
                                                                     load_module_strict=False))
    out["missing_rank_file"] = _missing_rank_file(fresh, rank, tmp)
    out["disk_full"] = _full_save_failure(engine, rank, tmp)
    out.update(_rank_unique_tags(engine, rank, tmp, stage, warnings))
    if stage == 2:
        out["unused"] = {ignore: _unused_parameters(rank, world, ignore) for ignore in (True, False)}
    logging.getLogger("deepshard").removeHandler(warnings)
    return out


def _rank_unique_tags(engine: Any, rank: int, tmp: Path, stage: int, warnings: _Warnings) -> dict[str, Any]:
    """Ranks passing different tags: the default ("Warn") warns and saves one whole checkpoint under rank
    0's tag; "Fail" raises on every rank an error that is also DeepSpeed's AssertionError; no directory
    raises ValueError (DeepSpeed's errors, checked by its unit test checkpoint/test_tag_validation.py)."""
    from deepshard.checkpoint.collective import CheckpointTagMismatch

    out: dict[str, Any] = {}
    warnings.messages.clear()
    out["unique_warn"] = _error(lambda: engine.save_checkpoint(str(tmp), tag=f"rank-{rank}"))
    out["unique_warnings"] = [m for m in warnings.messages if "different tags" in m]
    out["unique_dirs"] = sorted(p.name for p in tmp.iterdir() if p.name.startswith("rank-"))
    fresh, *_ = deepshard.initialize(model=make_model(seed=5), config=_config(stage))
    out["unique_loaded"] = _error(lambda: fresh.load_checkpoint(str(tmp), tag="rank-0"))
    out["unique_same"] = _same(full_weights(fresh), full_weights(engine))
    strict, *_ = deepshard.initialize(model=make_model(), config={**_config(stage),
                                                                   "checkpoint": {"tag_validation": "Fail"}})
    try:
        strict.save_checkpoint(str(tmp), tag=f"rank-{rank}-strict")
        out["unique_fail"] = "no error"
    except AssertionError as err:  # what DeepSpeed raises, and what user code may catch
        out["unique_fail"] = f"{type(err).__name__}: {err}"
        out["unique_fail_is_checkpoint_error"] = isinstance(err, CheckpointTagMismatch)
    out["no_dir"] = [_error(lambda: engine.save_checkpoint(d)) for d in (None, "")]
    return out


def _unused_parameters(rank: int, world: int, ignore: bool) -> list[str]:
    """TinyNetPlus's ``extra`` never reaches the loss: with ignore_unused_parameters false the first step
    raises on every rank (DeepSpeed's AssertionError, checked by its test_ignore_unused_parameters.py);
    with true (the default) two steps run."""
    cfg = _config(2)
    cfg["zero_optimization"]["ignore_unused_parameters"] = ignore
    engine, *_ = deepshard.initialize(model=TinyNetPlus(), config=cfg)
    outcomes = []
    for batch in make_batches(2, 2 * world):
        try:
            x, y = micro_slice(batch, 2, 0, rank, world)
            engine.backward(engine(x, y))
            engine.step()
            outcomes.append("stepped")
        except AssertionError as err:
            outcomes.append(f"{type(err).__name__}: {err}")
            break
    return outcomes


def _missing_rank_file(engine: Any, rank: int, tmp: Path) -> str:
    """A copy of 'good' without rank 1's files, whose manifest was rewritten to match."""
    dist.barrier()
    if rank == 0:
        shutil.copytree(tmp / "good", tmp / "partial")
        for name in ("zero_rank1.json", "zero_rank1.safetensors"):
            (tmp / "partial" / name).unlink()
        (tmp / "partial" / ckpt_io.MANIFEST_NAME).unlink()
        ckpt_io.write_manifest(tmp / "partial", [p.name for p in (tmp / "partial").iterdir()])
    dist.barrier()
    return _error(lambda: engine.load_checkpoint(str(tmp), tag="partial"))


def asymmetric_zero3(rank: int, world: int, case: str) -> str:
    """One rank runs code the other does not, under ZeRO-3; the error each rank ends with."""
    from tests.multiproc.models import make_token_batches, make_transformer
    from tests.multiproc.scenarios_stage3 import z3_config

    os.environ["DEEPSHARD_TIMEOUT"] = str(4 / 60)
    engine, *_ = deepshard.initialize(model=make_transformer(), config=z3_config(4 // world, 1))
    x, y = make_token_batches(1, 4)[0]
    start = time.monotonic()
    try:
        if rank == 1 and case == "extra_no_grad_forward":
            with torch.no_grad():
                engine(x[:2], y[:2])
        if not (rank == 1 and case == "skipped_forward"):
            loss = engine(x[:2], y[:2])
            engine.backward(loss)
        engine.step()
        return f"no error after {time.monotonic() - start:.1f}s"
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__} after {time.monotonic() - start:.1f}s: {err}"


def save_on_one_rank(rank: int, world: int, stage: int) -> str:
    """Only rank 0 calls save_checkpoint (after one step) while rank 1 trains on: the save's agreement meets
    the gradient all-reduce (stage 0) or reduce-scatter; the error each rank ends with, and how fast."""
    os.environ["DEEPSHARD_TIMEOUT"] = str(3 / 60)
    engine, *_ = deepshard.initialize(model=make_model(), config=_config(stage))
    batches = make_batches(2, 2 * world)
    run_steps(engine, batches[:1], 2, 1, rank, world)
    start = time.monotonic()
    try:
        if rank == 0:
            engine.save_checkpoint(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"save-one-{os.getpid()}"))
        else:
            run_steps(engine, batches[1:], 2, 1, rank, world)
        return f"no error after {time.monotonic() - start:.1f}s"
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__} after {time.monotonic() - start:.1f}s: {err}"


def pipeline_disagreement(rank: int, world: int, case: str) -> str:
    """Two pipeline stages that disagree: ``gas`` (stage 1 configured with 4 micro-batches, stage 0 with 2),
    or ``short`` (the first stage's iterator holds one item fewer than a batch needs, after one good batch).
    The error each rank ends with, and how fast."""
    from tests.multiproc.scenarios_pipe import _engine, _step_data

    os.environ["DEEPSHARD_TIMEOUT"] = str(3 / 60)
    m = 4 if (case == "gas" and rank == 1) else 2
    start = time.monotonic()
    try:
        _, engine = _engine(2, m, 0)
        engine.train_batch(_step_data(0, m, 1, 0))
        data = list(_step_data(1, m, 1, 0))
        engine.train_batch(iter(data[:1] if rank == 0 else data))
        return f"no error after {time.monotonic() - start:.1f}s"
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__} after {time.monotonic() - start:.1f}s: {err}"


def _damaged_copy(tmp: Path, name: str, damage: Any) -> None:
    """Rank 0: copy checkpoint 'good' to ``name``, apply ``damage(dir)``, rewrite the manifest to match (so
    only the files' contents can tell)."""
    target = tmp / name
    shutil.copytree(tmp / "good", target)
    damage(target)
    (target / ckpt_io.MANIFEST_NAME).unlink()
    ckpt_io.write_manifest(target, [p.name for p in target.iterdir()])


def _swap(a: str, b: str) -> Any:
    def damage(d: Path) -> None:
        os.rename(d / a, d / "swap.tmp")
        os.rename(d / b, d / a)
        os.rename(d / "swap.tmp", d / b)
    return damage


def _edit_json(name: str, edit: Any) -> Any:
    def damage(d: Path) -> None:
        import json

        (d / name).write_text(json.dumps(edit(json.loads((d / name).read_text()))))
    return damage


DAMAGES = {
    "steps_not_a_number": _edit_json("engine.json", lambda m: {**m, "global_steps": "abc"}),
    "no_state": _edit_json("engine.json", lambda m: {k: v for k, v in m.items() if k != "state"}),
    "rank_file_a_list": _edit_json("zero_rank0.json", lambda m: [1, 2, 3]),
    "rank_jsons_swapped": _swap("zero_rank0.json", "zero_rank1.json"),
    "rank_tensors_swapped": _swap("zero_rank0.safetensors", "zero_rank1.safetensors"),
    "rng_and_rank_tensors_swapped": _swap("rng_rank0.safetensors", "zero_rank1.safetensors"),
    "rng_deleted": lambda d: (d / "rng_rank0.safetensors").unlink(),  # last: only rank 0 can tell
}


def damaged_checkpoints(rank: int, world: int, tmp_root: str) -> dict[str, str]:
    """Checkpoints whose files were edited, swapped or deleted behind a valid manifest: what loading each
    raises (the message and the seconds it took)."""
    os.environ["DEEPSHARD_TIMEOUT"] = str(3 / 60)
    tmp = Path(tmp_root)
    engine, *_ = deepshard.initialize(model=make_model(), config=_config(2))
    run_steps(engine, make_batches(1, 2 * world), 2, 1, rank, world)
    engine.save_checkpoint(str(tmp), tag="good")
    if rank == 0:
        for name, damage in DAMAGES.items():
            _damaged_copy(tmp, name, damage)
    dist.barrier()
    out = {}
    for name in DAMAGES:
        start = time.monotonic()
        message = _error(lambda: engine.load_checkpoint(str(tmp), tag=name))
        out[name] = f"{message} [{time.monotonic() - start:.1f}s]"
    return out


def stalled_rank(rank: int, world: int, stage: int) -> str:
    """Rank 1 stalls 12 s before its backward (DEEPSHARD_TIMEOUT = 3 s): rank 0's gradient reduction must
    end at the timeout, naming it; rank 1 then finds rank 0 gone."""
    os.environ["DEEPSHARD_TIMEOUT"] = str(3 / 60)
    engine, *_ = deepshard.initialize(model=make_model(), config=_config(stage))
    x, y = make_batches(1, 2 * world)[0]
    start = time.monotonic()
    try:
        loss = engine(x[:2], y[:2])
        if rank == 1:
            time.sleep(12)
        engine.backward(loss)
        engine.step()
        return f"no error after {time.monotonic() - start:.1f}s"
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__} after {time.monotonic() - start:.1f}s: {err}"
