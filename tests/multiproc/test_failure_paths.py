"""Failure paths: a save that fails on one rank fails on all with one message; wrong, damaged or
half-published checkpoints never load silently; interrupted saves are cleaned up."""
from __future__ import annotations

from typing import Any

import pytest

from tests.multiproc.harness import run_world
from tests.multiproc.scenarios_failure import (asymmetric_zero3, checkpoint_failures, damaged_checkpoints,
                                              pipeline_disagreement, save_on_one_rank, stalled_rank)

WORLD = 2


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: Any) -> list[dict[int, dict[str, Any]]]:
    return run_world(checkpoint_failures, WORLD, str(tmp_path_factory.mktemp("fail")), timeout=240)


@pytest.fixture(params=[2, 3], ids=["stage2", "stage3"])
def ckpt(request: Any, worlds: list[dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [per_rank[request.param] for per_rank in worlds]


def test_a_save_failing_on_one_rank_fails_on_every_rank_with_one_message(ckpt: list[dict[str, Any]]) -> None:
    messages = [out["disk_full"]["message"] for out in ckpt]
    assert messages[0] == messages[1], messages
    msg = messages[0]
    assert msg.startswith("CheckpointSaveError: save_checkpoint failed on rank(s) [1]"), msg
    assert "zero_rank1" in msg and ".tmp-good" in msg, msg  # the file and its directory
    assert "No space left on device" in msg and "bytes free" in msg and "needs" in msg, msg
    assert all(out["disk_full"]["seconds"] < 30 for out in ckpt)
    assert ckpt[0]["disk_full"]["leftovers"] == [], ckpt[0]["disk_full"]  # staging removed


def test_an_interrupted_same_tag_publication_is_recovered_on_load(ckpt: list[dict[str, Any]]) -> None:
    for out in ckpt:
        assert out["recovered"] == "no error", out["recovered"]
        assert out["recovered_same"] is True


def test_stale_staging_directories_are_removed_by_the_next_save(ckpt: list[dict[str, Any]]) -> None:
    assert ckpt[0]["after_save"] == [], ckpt[0]["after_save"]


def test_unexpected_names_refuse_strict_loads_and_warn_lenient_ones(ckpt: list[dict[str, Any]]) -> None:
    out = ckpt[0]
    assert out["unexpected_strict"].startswith("KeyError") and "'extra'" in out["unexpected_strict"], out
    assert out["unexpected_lenient"] == "no error", out["unexpected_lenient"]
    assert any("'extra'" in m and "load_module_strict=False" in m for m in out["lenient_warnings"]), out


def test_a_checkpoint_sharing_no_name_is_refused_even_when_lenient(ckpt: list[dict[str, Any]]) -> None:
    msg = ckpt[0]["no_match_lenient"]
    assert msg.startswith("CheckpointError") and "No name matches" in msg, msg


def test_a_missing_rank_file_is_reported_as_damage_not_as_a_strictness_problem(
        ckpt: list[dict[str, Any]]) -> None:
    msg = ckpt[0]["missing_rank_file"]
    assert msg.startswith("CheckpointError") and "is incomplete" in msg and "zero_rank1" in msg, msg
    assert "pass load_module_strict=False" not in msg, msg


def test_rank_unique_tags_follow_tag_validation_and_a_missing_directory_is_refused(
        ckpt: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(ckpt):
        assert out["unique_warn"] == "no error", out["unique_warn"]
        assert len(out["unique_warnings"]) == 1 and "'rank-1'" in out["unique_warnings"][0], out
        assert out["unique_loaded"] == "no error" and out["unique_same"] is True, out
        msg = out["unique_fail"]
        assert msg.startswith("CheckpointTagMismatch") and "rank 1: 'rank-1-strict'" in msg, msg
        assert out["unique_fail_is_checkpoint_error"] is True
        assert [m.split(":")[0] for m in out["no_dir"]] == ["ValueError", "ValueError"], out["no_dir"]
    assert ckpt[0]["unique_dirs"] == ["rank-0"], ckpt[0]["unique_dirs"]


def test_unused_parameters_stop_every_rank_when_not_ignored(worlds: list[dict[int, dict[str, Any]]]) -> None:
    for per_rank in worlds:
        out = per_rank[2]["unused"]
        assert out[True] == ["stepped", "stepped"], out
        assert len(out[False]) == 1 and out[False][0].startswith("UnusedParametersError: ZeRO stage 2"), out
        assert "'extra'" in out[False][0] and "ignore_unused_parameters" in out[False][0], out


def test_rank_asymmetric_zero3_code_ends_naming_the_other_rank_and_module() -> None:
    """Rank 1 runs an extra forward under no_grad: gloo used to abort rank 0 on a size mismatch (or the
    ranks exchanged the wrong groups silently); now both ranks end in seconds with the positions."""
    outs = run_world(asymmetric_zero3, WORLD, "extra_no_grad_forward", timeout=120)
    for me, other in ((0, 1), (1, 0)):
        msg = outs[me]
        assert msg.startswith("CollectiveTimeout"), msg
        assert f"Rank {other} is waiting in a different collective" in msg, msg
        assert "all_gather of parameter group" in msg and ("(block." in msg or "(norm)" in msg), msg
        assert float(msg.split(" after ")[1].split("s:")[0]) < 30, msg


@pytest.mark.parametrize("stage", [0, 2])
def test_a_save_called_on_one_rank_ends_naming_both_positions_and_the_step(stage: int) -> None:
    """Rank 0 saves while rank 1 trains on: at ZeRO-0 the save's agreement met the gradient all-reduce and
    gloo aborted rank 0 (SIGABRT, no message). Now both ranks end within seconds, each naming its own wait
    and the other's, at which step, and the timeout that fired (DEEPSHARD_TIMEOUT)."""
    outs = run_world(save_on_one_rank, WORLD, stage, timeout=120)
    assert outs[0].startswith("CollectiveTimeout"), outs
    assert "save_checkpoint's barrier" in outs[0] and "step 1" in outs[0], outs[0]
    assert "Rank 1 is waiting in a different collective" in outs[0] and "at step 1" in outs[0], outs[0]
    assert "DEEPSHARD_TIMEOUT=0.05 minutes" in outs[0] or "closed its connection" in outs[0], outs[0]
    assert outs[1].startswith("CollectiveTimeout") and "save_checkpoint's barrier" in outs[1], outs[1]
    for out in outs:
        assert float(out.split(" after ")[1].split("s:")[0]) < 30, out


def _seconds(out: str) -> float:
    return float(out.split(" after ")[1].split("s:")[0])


def test_pipeline_stages_given_different_accumulation_steps_are_refused_at_initialize() -> None:
    """Stage 1 configured with 4 micro-batches per batch, stage 0 with 2: the stages used to run out of step
    until gloo's receive timed out (60 s at DEEPSHARD_TIMEOUT=1), blaming the wrong rank."""
    outs = run_world(pipeline_disagreement, WORLD, "gas", timeout=120)
    for out in outs:
        assert out.startswith("ConfigError"), out
        assert "gradient_accumulation_steps: 2 on rank(s) [0], 4 on rank(s) [1]" in out, out
        assert _seconds(out) < 30, out


def test_a_pipeline_stage_whose_data_runs_short_ends_both_stages_naming_the_transfer() -> None:
    """The first stage's iterator runs short in the second batch: it raises; the last stage, waiting for
    activations, used to wait for gloo's own timeout. Now it ends within seconds naming the transfer, the
    stage it waited for and the step."""
    # fresh interpreters: a rank forked from the preloaded server exits at once after its last call, and stage 0's
    # connections closing that early can reset stage 1's receive of micro-batch 0 before it was read (the
    # message then names micro-batch 0); an interpreter's own exit leaves stage 1 the time to read it
    outs = run_world(pipeline_disagreement, WORLD, "short", timeout=120, fresh=True)
    assert outs[0].startswith("PipelineError") and "ran out at micro-batch 1 of 2" in outs[0], outs[0]
    assert outs[1].startswith("CollectiveTimeout"), outs[1]
    assert "stage 1 (rank 1): receive of activations of micro-batch 1 from stage 0 (rank 0)" in outs[1], outs[1]
    assert "step 1" in outs[1], outs[1]
    assert _seconds(outs[1]) < 30, outs[1]


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: Any) -> list[dict[str, str]]:
    return run_world(damaged_checkpoints, WORLD, str(tmp_path_factory.mktemp("damaged")), timeout=180)


@pytest.mark.parametrize("case,expect", [
    ("steps_not_a_number", ["engine.json is not a valid engine file", "'global_steps' should be an integer",
                            "str 'abc'"]),
    ("no_state", ["engine.json is not a valid engine file", "'state' is missing"]),
    ("rank_file_a_list", ["zero_rank0.json is not a valid rank file", "should be a mapping, found list"]),
    ("rank_jsons_swapped", ["zero_rank{r}.json holds rank {o}'s fragments, not rank {r}'s", "swapped or renamed"]),
    ("rank_tensors_swapped", ["zero_rank{r}.safetensors holds the tensors written as zero_rank{o}.safetensors"]),
    ("rng_and_rank_tensors_swapped", ["holds the tensors written as", "swapped or renamed"]),
])
def test_a_damaged_file_behind_a_valid_manifest_is_named(damaged: list[dict[str, str]], case: str,
                                                         expect: list[str]) -> None:
    """Raw KeyError / AttributeError / 'invalid literal for int()' before; each names the file now. Each rank
    reads only its own rank files, so in the swapped cases each names its own file ({r}) and the other's ({o})."""
    for rank, out in enumerate(damaged):
        msg = out[case]
        assert msg.startswith("CheckpointError"), msg
        for part in expect:
            assert part.format(r=rank, o=1 - rank) in msg, msg
        assert float(msg.rsplit("[", 1)[1].rstrip("s]")) < 30, msg


def test_a_missing_rng_file_is_an_error_not_a_silent_skip(damaged: list[dict[str, str]]) -> None:
    msg = damaged[0]["rng_deleted"]
    assert msg.startswith("CheckpointError") and "rng_rank0.safetensors" in msg and "is missing" in msg, msg


def test_a_stalled_rank_ends_the_others_at_deepshard_timeout_naming_it() -> None:
    """ZeRO-2, rank 1 stalls: with DEEPSHARD_TIMEOUT=1 rank 0 used to wait on (the watchdog's own 300 s
    overrode it). Now rank 0 ends at the configured 3 s, and the message states that timeout and its source."""
    out = run_world(stalled_rank, WORLD, 2, timeout=120)[0]
    assert out.startswith("CollectiveTimeout"), out
    assert "did not complete within 3s (DEEPSHARD_TIMEOUT=0.05 minutes)" in out, out
    assert "Rank(s) [1] did not arrive" in out and "step 0" in out, out
    assert _seconds(out) < 12, out
