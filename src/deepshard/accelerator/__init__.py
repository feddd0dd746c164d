"""The device in one place: cpu or cuda, its collective backend, synchronization and memory figures.

Everything that differs between CPU and CUDA lives here so the engine and strategies are the same code
on both (DESIGN.md principle: no `assert backend == "nccl"`).

:func:`get_accelerator` is also DeepSpeed's ``deepspeed.accelerator.get_accelerator()``: the object it
returns answers DeepSpeed's method names (``device_name(i)``, ``current_device_name()``,
``communication_backend_name()``, ``is_bf16_supported()``, ``synchronize()``, ``manual_seed``,
``empty_cache``, ``memory_allocated`` ...), for scripts and libraries (Accelerate, transformers) that
call them. The class is :class:`DeviceAccelerator`; the name ``Accelerator`` belongs to the
Accelerate-style training interface (``deepshard.accelerate``).
"""
from __future__ import annotations

import functools
import os
import random
from dataclasses import dataclass
from typing import Any

import psutil
import torch

KINDS = ("cpu", "cuda")


def _positive_env_int(name: str, default: int) -> int:
    """``int(os.environ[name])`` when it is a positive integer, else ``default`` (unset, empty or 0);
    anything else is an error naming the variable."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer; set it to the number of processes on this "
                         "node, or unset it") from None
    return value if value > 0 else default


@dataclass(frozen=True)
class DeviceAccelerator:
    """One process's device. ``kind`` is ``"cpu"`` or ``"cuda"``; ``index`` the CUDA device index."""

    kind: str
    index: int = 0

    # ---------------------------------------------------------------------- deepshard's own names
    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device(self.kind, self.index)

    @property
    def backend(self) -> str:
        return "nccl" if self.kind == "cuda" else "gloo"

    @property
    def _name(self) -> str:
        """DeepSpeed's accelerator attribute naming its kind (``"cpu"``, ``"cuda"``), read in messages."""
        return self.kind

    def set_device(self, device_index: int | None = None) -> None:
        """Make this process's CUDA device current (DeepSpeed's ``set_device(i)`` takes an index)."""
        if self.kind == "cuda":
            torch.cuda.set_device(self.index if device_index is None else int(device_index))

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for the device's queued work (a no-op on CPU, where work is synchronous)."""
        if self.kind == "cuda":
            torch.cuda.synchronize(self.index if device_index is None else int(device_index))

    # ------------------------------------------------------------------------- device naming
    def device_name(self, device_index: int | str | None = None) -> str:
        """``"cuda"`` or ``"cuda:<i>"``; ``"cpu"`` whatever the index (DeepSpeed's CPU accelerator)."""
        if self.kind == "cpu" or device_index is None:
            return self.kind
        return f"{self.kind}:{int(device_index)}"

    def current_device(self) -> int:
        """The current device index (0 on CPU)."""
        return torch.cuda.current_device() if self.kind == "cuda" else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self.kind == "cuda" else "cpu"

    def device_count(self) -> int:
        """CUDA devices visible; on CPU the ``LOCAL_SIZE`` environment variable (the processes a launcher
        starts on this node, each with its own "device"), else 1. DeepSpeed's CPU accelerator counts the same
        way, and code (its unit tests among it) compares this count with the processes it is about to start."""
        if self.kind == "cuda":
            return torch.cuda.device_count()
        return _positive_env_int("LOCAL_SIZE", default=1)

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self.kind == "cuda" else True

    def communication_backend_name(self) -> str:
        return self.backend

    def is_synchronized_device(self) -> bool:
        """True when kernels run synchronously with the host (CPU)."""
        return self.kind == "cpu"

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    # --------------------------------------------------------------------------------- dtypes
    def is_bf16_supported(self) -> bool:
        """bf16 arithmetic: always on CPU (torch's kernels), on CUDA when the device supports it."""
        return torch.cuda.is_bf16_supported() if self.kind == "cuda" else True

    def is_fp16_supported(self) -> bool:
        """fp16 training: CUDA devices. On CPU deepshard trains fp16 too, but slowly; DeepSpeed's CPU
        accelerator answers False, and so does this."""
        return self.kind == "cuda"

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    # ---------------------------------------------------------------------------------- seeds
    def manual_seed(self, seed: int) -> None:
        """Seed this device's generator (CPU: torch's default generator)."""
        if self.kind == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self.kind == "cuda":
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self.kind == "cuda" else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self.kind == "cuda":
            return torch.cuda.get_rng_state(self.index if device_index is None else int(device_index))
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self.kind == "cuda":
            torch.cuda.set_rng_state(new_state, self.index if device_index is None else int(device_index))
        else:
            torch.set_rng_state(new_state)

    def random(self) -> Any:
        """The ``random`` module DeepSpeed's accelerators return here (Python's, shared by host code)."""
        return random

    # --------------------------------------------------------------------------------- memory
    def empty_cache(self) -> None:
        """Return cached allocator blocks to the device (nothing is cached on CPU)."""
        if self.kind == "cuda":
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes currently held: CUDA allocator bytes, or this process's resident set size on CPU."""
        if self.kind == "cuda":
            return int(torch.cuda.memory_allocated(self._index(device_index)))
        return int(psutil.Process().memory_info().rss)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak bytes: CUDA allocator peak, or the process's peak resident set size on CPU."""
        if self.kind == "cuda":
            return int(torch.cuda.max_memory_allocated(self._index(device_index)))
        import resource

        # the kernel's peak is updated lazily: never report a peak below the current resident size
        return max(int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, self.memory_allocated())

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats(self._index(device_index))

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        """Bytes the CUDA allocator holds (incl. cache); on CPU the resident set size."""
        if self.kind == "cuda":
            return int(torch.cuda.memory_reserved(self._index(device_index)))
        return self.memory_allocated()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        if self.kind == "cuda":
            return int(torch.cuda.max_memory_reserved(self._index(device_index)))
        return self.max_memory_allocated()

    def total_memory(self, device_index: int | None = None) -> int:
        """The device's memory: the CUDA device's total, or the machine's RAM on CPU."""
        if self.kind == "cuda":
            return int(torch.cuda.get_device_properties(self._index(device_index)).total_memory)
        return int(psutil.virtual_memory().total)

    def available_memory(self, device_index: int | None = None) -> int:
        """Free bytes: CUDA's free memory (``mem_get_info``), or available RAM on CPU."""
        if self.kind == "cuda":
            return int(torch.cuda.mem_get_info(self._index(device_index))[0])
        return int(psutil.virtual_memory().available)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        if self.kind == "cuda":
            return dict(torch.cuda.memory_stats(self._index(device_index)))
        return {"allocated_bytes.all.current": self.memory_allocated(),
                "allocated_bytes.all.peak": self.max_memory_allocated()}

    # -------------------------------------------------------------------------------- tensors
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """Page-locked copy of a host tensor when a CUDA device will read it (counted by
        :mod:`deepshard.utils.pin_memory_tracker`); unchanged on CPU."""
        if self.kind != "cuda":
            return tensor
        from deepshard.utils.pin_memory_tracker import track_pinned_memory

        pinned = tensor.pin_memory()
        track_pinned_memory(pinned.nbytes)
        return pinned

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_pinned()) if self.kind == "cuda" else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.kind

    def Stream(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - DeepSpeed's name
        if self.kind != "cuda":
            raise NotImplementedError("streams exist on CUDA only; on CPU work is synchronous, no stream needed")
        return torch.cuda.Stream(*args, **kwargs)

    def stream(self, stream: Any) -> Any:
        if self.kind != "cuda":
            import contextlib

            return contextlib.nullcontext()
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(self._index(device_index)) if self.kind == "cuda" else None

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(self._index(device_index)) if self.kind == "cuda" else None

    # ---------------------------------------------------------------------- DeepSpeed's odds and ends
    def lazy_call(self, callback: Any) -> None:
        """Run ``callback`` once the device is initialised: queued by CUDA until then; at once on CPU."""
        if self.kind == "cuda":
            torch.cuda._lazy_call(callback)
        else:
            callback()

    def default_generator(self, device_index: int | None = None) -> torch.Generator:
        """The device's default random generator (torch's CPU generator on CPU)."""
        if self.kind == "cuda":
            return torch.cuda.default_generators[self._index(device_index)]
        return torch.default_generator

    def get_op_builder(self, class_name: str) -> Any:
        raise NotImplementedError(
            f"get_op_builder({class_name!r}): deepshard builds no DeepSpeed ops (no JIT-compiled kernels); its "
            "optimizers are deepshard.ops.adam.DeepSpeedCPUAdam / FusedAdam on top of torch.optim")

    def _tensor_factory(self, dtype: torch.dtype) -> Any:
        return functools.partial(torch.tensor, dtype=dtype, device=self.device)

    # DeepSpeed's typed tensor constructors: ``get_accelerator().FloatTensor(data)`` on this device
    BFloat16Tensor = property(lambda self: self._tensor_factory(torch.bfloat16))
    ByteTensor = property(lambda self: self._tensor_factory(torch.uint8))
    DoubleTensor = property(lambda self: self._tensor_factory(torch.float64))
    FloatTensor = property(lambda self: self._tensor_factory(torch.float32))
    HalfTensor = property(lambda self: self._tensor_factory(torch.float16))
    IntTensor = property(lambda self: self._tensor_factory(torch.int32))
    LongTensor = property(lambda self: self._tensor_factory(torch.int64))

    def _index(self, device_index: int | None) -> int:
        return self.index if device_index is None else int(device_index)


def get_accelerator(local_rank: int | None = None) -> DeviceAccelerator:
    """Pick the device: ``DEEPSHARD_ACCELERATOR`` (or DeepSpeed's ``DS_ACCELERATOR``) wins, else CUDA when
    available, else CPU. On CUDA the device index is the local rank."""
    forced = os.environ.get("DEEPSHARD_ACCELERATOR") or os.environ.get("DS_ACCELERATOR")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if forced:
        if forced not in KINDS:
            raise ValueError(
                f"DEEPSHARD_ACCELERATOR={forced!r} is not a known accelerator; use 'cpu' or 'cuda'")
        if forced == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("DEEPSHARD_ACCELERATOR=cuda but torch.cuda.is_available() is False; "
                               "install a CUDA build of torch or set DEEPSHARD_ACCELERATOR=cpu")
        kind = forced
    else:
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        return DeviceAccelerator("cuda", cuda_index(local_rank))
    return DeviceAccelerator("cpu", 0)


def cuda_index(local_rank: int | None = None) -> int:
    """The CUDA device a rank uses: its local rank (``LOCAL_RANK`` when not given) modulo the visible devices."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return local_rank % max(torch.cuda.device_count(), 1)


SUPPORTED_ACCELERATOR_LIST: list[str] = list(KINDS)
"""The device kinds deepshard runs on (DeepSpeed's list has more vendors)."""


def is_current_accelerator_supported() -> bool:
    """Whether the accelerator this process picked is one deepshard supports (always, for cpu and cuda)."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""x86 CPU features with bf16 arithmetic; without them torch emulates bf16 matmuls (measured on an AMD
EPYC with AVX2 only: 28 s per demo step in bf16 against 1.7 s in fp32)."""


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether this x86 CPU computes bf16 natively (``avx512_bf16`` or ``amx_bf16``); None where that
    cannot be told (not Linux, not x86: an ARM CPU's bf16 support is not judged here)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
                cpuinfo = fh.read()
        except OSError:
            return None
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), None)
    if flags is None:
        return None
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def set_accelerator(accel: Any) -> None:
    """DeepSpeed's ``set_accelerator``: make ``accel`` (an accelerator object of kind ``"cpu"`` or ``"cuda"``,
    e.g. ``CPU_Accelerator()``) this process's device. The choice is kept where :func:`get_accelerator` reads
    it, the process's ``DEEPSHARD_ACCELERATOR`` variable (so processes started from here inherit it too)."""
    name_of = getattr(accel, "device_name", None)
    kind = name_of() if callable(name_of) else None
    if kind not in KINDS:
        raise ValueError(f"set_accelerator({accel!r}): deepshard runs on {' or '.join(KINDS)}, and this accelerator "
                         f"names its device {kind!r}; pass deepspeed.accelerator.cpu_accelerator.CPU_Accelerator() "
                         "or cuda_accelerator.CUDA_Accelerator()")
    if kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("set_accelerator(CUDA accelerator) but torch.cuda.is_available() is False; install a "
                           "CUDA build of torch or pass CPU_Accelerator()")
    os.environ["DEEPSHARD_ACCELERATOR"] = kind
