"""Sections read outside the config model (tensor_parallel, autotuning), the profiler's output file and
OneBitAdam's backend name are checked as strictly as the rest, at load time, naming the key."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.config import load_config

BASE = {"train_micro_batch_size_per_gpu": 2}


def _load(**sections: Any) -> Any:
    return load_config({**BASE, **sections}, dp_world_size=1)


@pytest.mark.parametrize("section,message", [
    ({"autotp_sizee": 2}, "unknown config key 'tensor_parallel.autotp_sizee'; did you mean 'autotp_size'?"),
    ({"tp": {"tp_sise": 2}}, "unknown config key 'tensor_parallel.tp.tp_sise'; did you mean 'tp_size'?"),
    ({"autotp_size": 2, "partition_config": {"layer_spec": []}},
     "unknown config key 'tensor_parallel.partition_config.layer_spec'; did you mean 'layer_specs'?"),
    ({"autotp_size": 2, "dtype": "fp12"}, "tensor_parallel.dtype 'fp12' is not a dtype"),
    ("two", "tensor_parallel must be an object"),
])
def test_tensor_parallel_typos_and_bad_values_are_refused(section: Any, message: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        _load(tensor_parallel=section)
    assert message in str(info.value), str(info.value)


def test_a_valid_tensor_parallel_section_loads() -> None:
    cfg = _load(tensor_parallel={"autotp_size": 2, "tp_overlap_comm": False,
                                 "partition_config": {"use_default_specs": True, "layer_specs": []}})
    assert cfg.tensor_parallel["autotp_size"] == 2


@pytest.mark.parametrize("section,message", [
    ({"enabled": "yes"}, "autotuning.enabled = 'yes': expected true or false"),
    ({"enabled": True, "fastt": True}, "fastt"),
    ({"max_train_batch_size": -4}, "autotuning.max_train_batch_size = -4: expected a whole number >= 1"),
    ("on", "autotuning must be an object"),
    ({"tuner_type": "bayes"}, "autotuning.tuner_type = 'bayes'"),
    ({"metric": "speed"}, "autotuning.metric = 'speed'"),
])
def test_autotuning_garbage_is_refused(section: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        _load(autotuning=section)
    assert message in str(info.value), str(info.value)


def test_a_valid_autotuning_section_loads() -> None:
    assert _load(autotuning={"enabled": True, "fast": True, "max_train_batch_size": 64}).autotuning["fast"] is True


def test_an_unwritable_profiler_output_file_is_refused_at_load(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("")
    impossible = str(tmp_path / "a_file" / "dir" / "flops.txt")
    with pytest.raises(ValueError) as info:
        _load(flops_profiler={"enabled": True, "output_file": impossible})
    assert "flops_profiler.output_file" in str(info.value) and "cannot be created" in str(info.value)
    to_make = str(tmp_path / "no" / "such" / "dir" / "flops.txt")  # made by the profiler when it writes
    assert _load(flops_profiler={"enabled": True, "output_file": to_make}).flops_profiler.enabled
    assert _load(flops_profiler={"enabled": True, "output_file": str(tmp_path / "f.txt")}).flops_profiler.enabled
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="cannot be written"):
            _load(flops_profiler={"enabled": True, "output_file": str(locked / "f.txt")})


@pytest.mark.parametrize("backend", ["mpi", "hccl", "compressed"])
def test_onebit_adam_refuses_a_backend_it_would_not_use(backend: str) -> None:
    from deepshard.compression import OneBitAdam

    with pytest.raises(ValueError, match=f"comm_backend_name = '{backend}'"):
        OneBitAdam([torch.nn.Parameter(torch.zeros(2))], comm_backend_name=backend)
    assert OneBitAdam([torch.nn.Parameter(torch.zeros(2))], comm_backend_name="nccl").comm_backend_name == "nccl"
