"""The CPU adjustments of Accelerate and transformers (``deepshard/compat/hf_patches.py``): what they change,
and that an untested version stops with a message instead of being adjusted blindly."""
from __future__ import annotations

import types

import pytest

from deepshard.compat import hf_patches


def test_untested_versions_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_patches.importlib.metadata, "version", lambda dist: "9.0.0")
    monkeypatch.delenv(hf_patches.UNTESTED_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"tested with accelerate 1\.15\.x, but 9\.0\.0 is installed"):
        hf_patches.check_version("accelerate")
    monkeypatch.setenv(hf_patches.UNTESTED_ENV, "1")
    hf_patches.check_version("accelerate")
    monkeypatch.setattr(hf_patches.importlib.metadata, "version", lambda dist: "5.23.1")
    monkeypatch.delenv(hf_patches.UNTESTED_ENV)
    hf_patches.check_version("transformers")


def test_accelerate_backend_becomes_gloo_for_deepspeed_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    class PartialState:  # Accelerate's answer on a machine without a GPU: no backend
        def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
            return ("gloo", "MULTI_CPU_OWN") if cpu else (None, "NO")

    module = types.SimpleNamespace(PartialState=PartialState,
                                   DistributedType=types.SimpleNamespace(MULTI_CPU="MULTI_CPU"))
    monkeypatch.setattr(hf_patches, "check_version", lambda dist: None)
    monkeypatch.setattr(hf_patches, "on_cpu", lambda: True)
    hf_patches.patch_accelerate_state(module)  # type: ignore[arg-type]
    adjusted = PartialState._prepare_backend
    hf_patches.patch_accelerate_state(module)  # type: ignore[arg-type]
    assert PartialState._prepare_backend is adjusted  # applied once
    state = PartialState()
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert state._prepare_backend(False) == ("gloo", "MULTI_CPU")  # DeepSpeed launched: the real gloo world
    assert state._prepare_backend(True) == ("gloo", "MULTI_CPU_OWN")  # cpu=True: Accelerate's own answer
    assert state._prepare_backend(False, backend="nccl") == (None, "NO")  # a backend asked for: untouched
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    assert state._prepare_backend(False) == (None, "NO")  # no DeepSpeed asked: untouched
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert state._prepare_backend(False) == (None, "NO")  # not launched: a world of one


def test_bf16_check_is_adjusted_only_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.SimpleNamespace(is_torch_bf16_gpu_available=lambda: False)
    monkeypatch.setattr(hf_patches, "check_version", lambda dist: None)
    monkeypatch.setattr(hf_patches, "on_cpu", lambda: False)
    hf_patches.patch_training_args(module)  # type: ignore[arg-type]
    assert module.is_torch_bf16_gpu_available() is False
    monkeypatch.setattr(hf_patches, "on_cpu", lambda: True)
    hf_patches.patch_training_args(module)  # type: ignore[arg-type]
    assert module.is_torch_bf16_gpu_available() is True


def test_main_process_first_is_a_rank_ordered_section() -> None:
    from deepshard.utils.rank_order import refuse_collectives_here

    seen = []

    class PartialState:
        def _goes_first(self, is_main):
            seen.append(("before", is_main))
            yield
            seen.append(("after", is_main))

    module = types.SimpleNamespace(PartialState=PartialState)
    hf_patches.guard_main_process_first(module)  # type: ignore[arg-type]
    guarded = PartialState._goes_first
    hf_patches.guard_main_process_first(module)  # type: ignore[arg-type]
    assert PartialState._goes_first is guarded  # applied once
    body = guarded(PartialState(), True)
    next(body)  # inside the block: collectives are refused, naming the section
    with pytest.raises(RuntimeError, match=r"zero.Init .* inside accelerate's main_process_first\(\)"):
        refuse_collectives_here("zero.Init")
    with pytest.raises(StopIteration):
        next(body)
    assert seen == [("before", True), ("after", True)]
    refuse_collectives_here("zero.Init")  # outside: allowed


def test_rank_ordered_sections_nest_and_are_per_thread() -> None:
    import threading

    from deepshard.utils.rank_order import rank_ordered_section, refuse_collectives_here

    with rank_ordered_section("outer"):
        with rank_ordered_section("inner"):
            with pytest.raises(RuntimeError, match="inside inner"):
                refuse_collectives_here("x")
        with pytest.raises(RuntimeError, match="inside outer"):
            refuse_collectives_here("x")
        errors = []
        thread = threading.Thread(target=lambda: errors.append(refuse_collectives_here("x")))
        thread.start()
        thread.join()
        assert errors == [None]  # another thread is not inside this one's section
    refuse_collectives_here("x")


def test_extras_name_the_tested_series_the_runtime_check_accepts() -> None:
    """pyproject's HF extras are ranges over the series hf_patches.TESTED accepts at run time (not exact
    pins that rewrite a user's stack); the bench extra pins the DeepSpeed the docs compare against."""
    import tomllib
    from pathlib import Path

    from deepshard.compat.hf_patches import TESTED, tested_range

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for extra in ("dev", "hf", "accelerate"):
        for dist in TESTED:
            named = [req for req in extras[extra] if req.split(">")[0].split("=")[0] == dist]
            assert named in ([], [f"{dist}{tested_range(dist)}"]), (extra, named)
    assert tested_range("accelerate") == ">=1.15,<1.16"
    assert "deepspeed==0.19.8" in extras["bench"]


def test_a_newer_transformers_is_adjusted_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    import logging

    caplog.set_level(logging.WARNING, logger="deepshard")
    monkeypatch.delenv(hf_patches.UNTESTED_ENV, raising=False)
    monkeypatch.setattr(hf_patches.importlib.metadata, "version", lambda dist: "5.24.0")
    hf_patches.check_version("transformers")  # newer than 5.23.x: no error
    assert "was tested with transformers 5.23.x; 5.24.0 is newer and is adjusted the same way" in caplog.text
    # an older transformers, and a newer accelerate (its adjustment wraps a private method), still stop
    monkeypatch.setattr(hf_patches.importlib.metadata, "version", lambda dist: "5.22.3")
    with pytest.raises(RuntimeError, match=r"tested with transformers 5\.23\.x, but 5\.22\.3 is installed"):
        hf_patches.check_version("transformers")
    monkeypatch.setattr(hf_patches.importlib.metadata, "version", lambda dist: "1.16.0")
    with pytest.raises(RuntimeError, match=r"tested with accelerate 1\.15\.x, but 1\.16\.0 is installed"):
        hf_patches.check_version("accelerate")
