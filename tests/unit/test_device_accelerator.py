"""``deepshard.accelerator.get_accelerator()`` answers DeepSpeed's accelerator method names (CPU here)."""
from __future__ import annotations

import pytest
import torch

from deepshard.accelerator import DeviceAccelerator, get_accelerator


@pytest.fixture()
def cpu(monkeypatch: pytest.MonkeyPatch) -> DeviceAccelerator:
    monkeypatch.setenv("DEEPSHARD_ACCELERATOR", "cpu")
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    return get_accelerator()


def test_cpu_device_count_is_local_size(cpu: DeviceAccelerator, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's CPU accelerator counts LOCAL_SIZE devices (its DistributedTest skips a world larger than the
    count); unset or 0 is one device here (DeepSpeed then counts NUMA nodes, one on a plain machine)."""
    for value, expected in (("2", 2), ("4", 4), ("0", 1), ("", 1)):
        monkeypatch.setenv("LOCAL_SIZE", value)
        assert cpu.device_count() == expected, value
    monkeypatch.setenv("LOCAL_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_SIZE='two' is not an integer"):
        cpu.device_count()


def test_cpu_names_and_backend(cpu: DeviceAccelerator) -> None:
    assert isinstance(cpu, DeviceAccelerator) and cpu.device == torch.device("cpu")
    assert cpu.device_name() == "cpu" and cpu.device_name(1) == "cpu" and cpu.current_device_name() == "cpu"
    assert cpu.communication_backend_name() == "gloo" and cpu.current_device() == 0 and cpu.device_count() == 1
    assert cpu.is_available() and cpu.is_synchronized_device() and cpu.use_host_timers()
    assert cpu.is_bf16_supported() and not cpu.is_fp16_supported()
    assert cpu.supported_dtypes() == [torch.float32, torch.bfloat16]
    cpu.synchronize()
    cpu.empty_cache()
    cpu.set_device(0)


def test_cpu_seed_and_rng_state(cpu: DeviceAccelerator) -> None:
    cpu.manual_seed(123)
    a = torch.rand(3)
    state = cpu.get_rng_state()
    b = torch.rand(3)
    cpu.set_rng_state(state)
    assert torch.equal(torch.rand(3), b)
    cpu.manual_seed_all(123)
    assert torch.equal(torch.rand(3), a) and cpu.initial_seed() == 123


def test_cpu_memory_queries(cpu: DeviceAccelerator) -> None:
    held = cpu.memory_allocated()
    assert 0 < held <= cpu.max_memory_allocated() and held <= cpu.total_memory()
    assert 0 < cpu.available_memory() <= cpu.total_memory()
    assert cpu.memory_reserved() > 0 and cpu.max_memory_reserved() > 0
    assert cpu.memory_stats()["allocated_bytes.all.current"] > 0
    t = torch.ones(2)
    assert cpu.pin_memory(t) is t and not cpu.is_pinned(t) and cpu.on_accelerator(t)
    with cpu.stream(None):
        pass
    with pytest.raises(NotImplementedError, match="CUDA only"):
        cpu.Stream()


def test_unknown_accelerator_names_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPSHARD_ACCELERATOR", "tpu")
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        get_accelerator()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPSHARD_ACCELERATOR", "cuda")
    monkeypatch.setenv("LOCAL_RANK", "0")
    acc = get_accelerator()
    acc.set_device()
    assert acc.device_name(0) == "cuda:0" and acc.device_name() == "cuda"
    assert acc.current_device_name() == "cuda:0" and acc.communication_backend_name() == "nccl"
    assert acc.device_count() == torch.cuda.device_count() and acc.is_fp16_supported()
    x = torch.ones(1024, 1024, device="cuda")
    acc.synchronize()
    assert acc.memory_allocated() >= x.numel() * 4 and acc.max_memory_allocated() >= acc.memory_allocated()
    assert 0 < acc.available_memory() <= acc.total_memory()
    assert acc.is_pinned(acc.pin_memory(torch.ones(4)))
    del x
    acc.empty_cache()
    acc.manual_seed(5)
    assert acc.initial_seed() == 5


def test_native_bf16_is_read_from_the_cpu_flags() -> None:
    from deepshard.accelerator import cpu_has_native_bf16

    assert cpu_has_native_bf16("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n") is False
    assert cpu_has_native_bf16("flags\t\t: fpu avx2 avx512f avx512_bf16\n") is True
    assert cpu_has_native_bf16("flags\t\t: fpu amx_tile amx_bf16\n") is True
    assert cpu_has_native_bf16("Features\t: fp asimd bf16\n") is None  # ARM: not judged


def test_set_accelerator_chooses_the_device_get_accelerator_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepshard.accelerator import set_accelerator
    from deepshard.accelerator.cpu_accelerator import CPU_Accelerator

    # another choice first (restored after the test), so the check below sees set_accelerator's own
    monkeypatch.setenv("DEEPSHARD_ACCELERATOR", "cuda")
    set_accelerator(CPU_Accelerator())
    assert get_accelerator().device_name() == "cpu" and CPU_Accelerator().communication_backend_name() == "gloo"

    class Other:
        def device_name(self) -> str:
            return "xpu"

    with pytest.raises(ValueError, match="'xpu'"):
        set_accelerator(Other())
    if not torch.cuda.is_available():
        from deepshard.accelerator.cuda_accelerator import CUDA_Accelerator

        with pytest.raises(RuntimeError, match="is_available"):
            set_accelerator(CUDA_Accelerator())
    assert get_accelerator().device_name() == "cpu"  # a refused call changes nothing
