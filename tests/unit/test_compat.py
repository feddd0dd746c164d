"""``deepshard.compat``: ``import deepspeed`` resolves to deepshard's own objects, with distribution
metadata; features deepshard lacks fail by name; a real DeepSpeed is never shadowed unasked."""
from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import deepshard.compat as compat

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def shim():
    compat.uninstall()
    saved = sys.modules.pop("deepspeed", None)
    compat.install(replace_installed=True)  # the bench extra may have installed a real DeepSpeed here
    yield
    compat.uninstall()
    if saved is not None:
        sys.modules["deepspeed"] = saved


def test_deepspeed_names_are_deepshards_objects(shim: None) -> None:
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
    from deepspeed.runtime.zero import partition_parameters as pp

    import deepshard
    import deepshard.comm
    import deepshard.ops.adam
    import deepshard.zero

    assert deepspeed.initialize is deepshard.initialize and deepspeed.DeepSpeedEngine is deepshard.engine.EngineCore
    assert dist.get_rank is deepshard.comm.get_rank and dist.init_distributed is deepshard.init_distributed
    assert get_accelerator is deepshard.accelerator.get_accelerator
    assert DeepSpeedCPUAdam is deepshard.ops.adam.DeepSpeedCPUAdam
    assert deepspeed.zero.Init is deepshard.zero.Init and pp.GatheredParameters is deepshard.zero.GatheredParameters
    assert pp.zero_wrapper_for_fp_tensor_constructor(torch.zeros) is torch.zeros
    assert "WarmupLR" in VALID_LR_SCHEDULES
    base = torch.arange(10.0)
    cloned = clone_tensors_for_torch_save({"a": [base[:2]]})
    assert cloned["a"][0].tolist() == [0.0, 1.0] and cloned["a"][0].untyped_storage().nbytes() == 8
    assert not hasattr(deepshard.zero, "partition_parameters")  # deepshard's modules are left as they were


def test_distribution_metadata(shim: None) -> None:
    version = importlib.metadata.version("deepspeed")
    assert version == compat.shim_version() and version.startswith(compat.DEEPSPEED_CONTRACT + "+deepshard.")
    import deepspeed

    assert deepspeed.__version__ == version
    assert tuple(int(x) for x in version.split("+")[0].split(".")) >= (0, 9, 3)  # transformers' minimum


def test_missing_features_fail_by_name(shim: None) -> None:
    with pytest.raises(ImportError, match="tensor parallelism"):
        importlib.import_module("deepspeed.moe.mappings")  # experts under a Megatron mpu
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("deepspeed.not_a_module")
    import deepspeed

    with pytest.raises(AttributeError, match="deepspeed.no_such_name is not provided by this 'deepspeed'"):
        deepspeed.no_such_name  # noqa: B018
    # DeepSpeed's per-rank (local) calls are defined for ZeRO-3 parameters only: elsewhere they say so, naming
    # the full calls to use (the writers themselves are checked on 2 ranks in tests/multiproc/test_zero12.py)
    from deepspeed.utils import safe_get_local_grad, safe_set_full_fp32_param, safe_set_local_fp32_param

    for local in (safe_get_local_grad, safe_set_local_fp32_param):
        with pytest.raises(TypeError, match=f"{local.__name__} is defined for ZeRO stage 3 parameters only.*"
                                            "no deepshard engine.*safe_set_full_"):
            local(*([torch.nn.Parameter(torch.zeros(2))] + ([torch.ones(2)] if "set" in local.__name__ else [])))
    plain = torch.nn.Parameter(torch.zeros(2))
    safe_set_full_fp32_param(plain, torch.ones(2))  # a parameter no engine trains: written in place
    assert torch.equal(plain.detach(), torch.ones(2))


def test_sequence_parallel_names_resolve(shim: None) -> None:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (TiledFusedLogitsLoss, TiledMLP,  # noqa: F401
                                                                UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter,
                                                                sequence_tiled_compute)
    from deepspeed.runtime.utils import move_to_device
    from deepspeed.sequence.layer import DistributedAttention
    from deepspeed.utils import groups

    import deepshard.sp.hf as hf
    import deepshard.sp.ulysses as ulysses

    assert UlyssesSPAttentionHF is hf.UlyssesSPAttentionHF and DistributedAttention is ulysses.DistributedAttention
    assert groups._get_sequence_parallel_world_size() == 1 and groups._get_sequence_parallel_rank() == 0
    assert move_to_device({"a": [torch.ones(1)], "b": 3}, "cpu")["b"] == 3


def test_uninstall_forgets_the_aliases(shim: None) -> None:
    import deepspeed  # noqa: F401

    compat.uninstall()
    assert not compat.is_installed() and "deepspeed" not in sys.modules


def test_a_real_deepspeed_is_not_shadowed_unasked(tmp_path: Path) -> None:
    fake = tmp_path / "deepspeed"
    fake.mkdir()
    (fake / "__init__.py").write_text("REAL = True\n")
    code = textwrap.dedent("""
        import os, sys
        import deepshard.compat as compat
        try:
            compat.install()
        except RuntimeError as exc:
            print("REFUSED", "replace_installed=True" in str(exc))
        os.environ["DEEPSHARD_REPLACE_DEEPSPEED"] = "1"
        compat.install()
        import deepspeed
        print("SHIM", deepspeed.initialize.__module__)
        compat.uninstall()
        import deepspeed
        print("REAL", deepspeed.REAL)
        try:
            compat.install(replace_installed=True)
        except RuntimeError as exc:
            print("IMPORTED", "already imported" in str(exc))
    """)
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT / 'src'}", "PATH": "/usr/bin:/bin", "DEEPSHARD_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:4] == ["REFUSED True", "SHIM deepshard.bootstrap", "REAL True", "IMPORTED True"]


def test_cpu_optimizers_are_torchs_updates() -> None:
    from deepshard.ops.adagrad import DeepSpeedCPUAdagrad
    from deepshard.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepshard.ops.lion import DeepSpeedCPULion
    from deepshard.optim.lion import Lion

    # DeepSpeed's CPU Adam is its own fused kernel: ours is torch's fused one, bit for bit
    cases = [(lambda p: DeepSpeedCPUAdam(p, lr=0.1, weight_decay=0.1, adamw_mode=True),
              lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1, fused=True)),
             (lambda p: DeepSpeedCPUAdam(p, lr=0.1, weight_decay=0.1, adamw_mode=False),
              lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.1, fused=True)),
             (lambda p: FusedAdam(p, lr=0.1, weight_decay=0.1),
              lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1)),
             (lambda p: DeepSpeedCPUAdagrad(p, lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1)),
             (lambda p: DeepSpeedCPULion(p, lr=0.1, weight_decay=0.1), lambda p: Lion(p, lr=0.1, weight_decay=0.1))]
    for ours, theirs in cases:
        results = []
        for make in (ours, theirs):
            torch.manual_seed(0)
            w = torch.nn.Parameter(torch.randn(5))
            start = w.detach().clone()
            opt = make([w])
            for _ in range(3):
                opt.zero_grad()
                (w ** 3).sum().backward()
                opt.step()
            results.append(w.detach().clone())
        assert torch.equal(results[0], results[1]) and not torch.equal(results[0], start)  # same update, and one
    with pytest.raises(NotImplementedError, match="bias_correction=True"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.ones(1))], bias_correction=False)


def test_zero_init_refuses_a_one_rank_group_under_a_multiprocess_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-process group set up before ``zero.Init`` while the launcher says 4 processes: every rank would hold
    the whole model, so ``Init`` stops with the cause (DeepSpeed 0.19.8 does too); a group passed in is meant."""
    import torch.distributed as dist

    import deepshard

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    created = not dist.is_initialized()
    deepshard.init_distributed(verbose=False)  # one process, in-memory store
    try:
        monkeypatch.setenv("WORLD_SIZE", "4")
        with pytest.raises(RuntimeError, match="WORLD_SIZE=4 processes.*init_distributed"):
            with deepshard.zero.Init():
                torch.nn.Linear(2, 2)
        with deepshard.zero.Init(data_parallel_group=dist.group.WORLD):
            layer = torch.nn.Linear(2, 2)
        assert layer.weight.ds_numel == 4 and layer.weight.numel() == 0
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()



def test_accelerator_answers_deepspeeds_name_attribute() -> None:
    """``get_accelerator()._name``: DeepSpeed's attribute naming the kind, read in messages (its tests' skips)."""
    import deepshard

    assert deepshard.accelerator.get_accelerator()._name == "cpu"


def test_zeropp_weight_quantizer_round_trips_within_half_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """``partition_parameters.CUDAQuantizer`` (ZeRO++'s 8-bit weight quantizer under DeepSpeed's name): groups
    of at most 8000 values (a multiple of 8), one scale max|x|/127 per group computed here from the fp16
    values, each value back within half a step, in the dtype asked for; the kernel stays replaceable."""
    from deepshard.compat import cuda_quantizer
    from deepshard.compat.partition_parameters import CUDAQuantizer

    monkeypatch.setattr(CUDAQuantizer, "quantizer_cuda_module", None)
    torch.manual_seed(0)
    param = torch.randn(3 * 6000, dtype=torch.bfloat16) * torch.linspace(0.01, 3.0, 3 * 6000).to(torch.bfloat16)
    q, scales = CUDAQuantizer().quantize(param)
    assert q.dtype == torch.int8 and q.numel() == param.numel() and scales.numel() == 3  # 3 groups of 6000
    halves = param.to(torch.half).float().view(3, 6000)
    step = halves.abs().amax(dim=1) / 127
    assert torch.allclose(scales, step, rtol=1e-6)
    back = CUDAQuantizer().dequantize(q, scales, dtype=torch.bfloat16)
    assert back.dtype == torch.bfloat16
    error = (back.float().view(3, 6000) - halves).abs()
    assert bool((error <= step[:, None] / 2 + halves.abs() / 2**8 + 1e-6).all())  # + bf16's own rounding
    as_half = CUDAQuantizer().dequantize(q, scales)
    assert as_half.dtype == torch.half
    error = (as_half.float().view(3, 6000) - halves).abs()
    assert bool((error <= step[:, None] / 2 + halves.abs() / 2**10 + 1e-6).all())
    assert float(error.max()) > float(step.min()) / 8  # it did quantize (8 bits, not fp16's 11)
    assert cuda_quantizer.quantization_groups(8 * 1001, 8000) == 7  # the fewest groups with a size in 8s
    with pytest.raises(ValueError, match="multiple of 8 values, got 12"):
        CUDAQuantizer().quantize(torch.ones(12))
    with pytest.raises(NotImplementedError, match="symmetrically only"):
        cuda_quantizer.BlockQuantizerKernel().quantize(torch.ones(16), 2, 8, quant_type=1)

    class Recording:  # a stand-in kernel, as DeepSpeed's tests swap one in
        Symmetric = 0

        def quantize(self, values, groups, num_bits, quant_type):
            return values.to(torch.int8), torch.full((groups,), float(values.dtype == torch.half))

        def dequantize(self, quantized, scales, num_groups, num_bits, quant_type):
            return quantized.to(torch.half) * scales[0]

    monkeypatch.setattr(CUDAQuantizer, "quantizer_cuda_module", Recording())
    q, scales = CUDAQuantizer().quantize(torch.full((16,), 2.0, dtype=torch.bfloat16))
    assert scales.tolist() == [1.0]  # the kernel was handed fp16; 16 values make one group
    assert CUDAQuantizer().dequantize(q, scales, dtype=torch.float32).tolist() == [2.0] * 16
