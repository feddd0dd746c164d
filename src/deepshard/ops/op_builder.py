"""``deepspeed.ops.op_builder``: DeepSpeed's op builders, answering what deepshard has.

DeepSpeed compiles its kernels (just in time or at install) through one builder per op; code asks a
builder ``is_compatible()`` (or reads ``deepspeed.ops.__compatible_ops__[Builder.NAME]``) before it uses
the op. deepshard compiles nothing: its optimizers are torch's kernels under DeepSpeed's class names
(:mod:`deepshard.ops`). So a builder is compatible exactly when deepshard provides what the op is used
for (``cpu_adam`` -> ``DeepSpeedCPUAdam``, ``fused_adam`` -> ``FusedAdam``, ``cpu_adagrad``, ``cpu_lion``,
``fused_lion``, ``fused_lamb`` -> the ``Lamb`` optimizer); every other builder says it is not, with the
reason. ``load()`` never returns a compiled module: it raises, naming the Python class to use instead.
"""
from __future__ import annotations

from typing import Any

__all__ = ["ALL_OPS", "AsyncIOBuilder", "CPUAdagradBuilder", "CPUAdamBuilder", "CPULionBuilder",
           "FusedAdamBuilder", "FusedLambBuilder", "FusedLionBuilder", "GDSBuilder", "NotImplementedBuilder",
           "OpBuilder", "PinMemoryBuilder", "QuantizerBuilder", "TransformerBuilder", "UtilsBuilder",
           "compatible_ops", "get_default_compute_capabilities"]


class OpBuilder:
    """A DeepSpeed op as deepshard answers for it (module docstring)."""

    NAME = ""
    BUILD_VAR = ""
    provided_by: str | None = None
    """The deepshard class that does the op's job, or None when deepshard has nothing for it."""
    missing: str = "deepshard does not implement it"

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME
        self.error_log: str | None = None if self.provided_by else self.missing

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.name}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        """Whether deepshard provides this op's functionality (as a torch implementation)."""
        if verbose and not self.provided_by:
            from deepshard.utils.logging import logger

            logger.warning("%s is not compatible: %s", self.name, self.missing)
        return self.provided_by is not None

    def sources(self) -> list[str]:
        return []

    def include_paths(self) -> list[str]:
        return []

    def load(self, verbose: bool = True) -> Any:
        """Always raises: deepshard builds no compiled ops."""
        if self.provided_by:
            raise NotImplementedError(f"{type(self).__name__}().load(): deepshard compiles no ops; its "
                                      f"{self.provided_by} does this op's work with torch's kernels, use it instead")
        raise NotImplementedError(f"{type(self).__name__}().load(): {self.name} is not available in deepshard "
                                  f"({self.missing}); use the real DeepSpeed for it")

    def jit_load(self, verbose: bool = True) -> Any:
        return self.load(verbose)


class CPUAdamBuilder(OpBuilder):
    NAME = "cpu_adam"
    BUILD_VAR = "DS_BUILD_CPU_ADAM"
    provided_by = "deepspeed.ops.adam.DeepSpeedCPUAdam"


class FusedAdamBuilder(OpBuilder):
    NAME = "fused_adam"
    BUILD_VAR = "DS_BUILD_FUSED_ADAM"
    provided_by = "deepspeed.ops.adam.FusedAdam"


class CPUAdagradBuilder(OpBuilder):
    NAME = "cpu_adagrad"
    BUILD_VAR = "DS_BUILD_CPU_ADAGRAD"
    provided_by = "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad"


class CPULionBuilder(OpBuilder):
    NAME = "cpu_lion"
    BUILD_VAR = "DS_BUILD_CPU_LION"
    provided_by = "deepspeed.ops.lion.DeepSpeedCPULion"


class FusedLionBuilder(OpBuilder):
    NAME = "fused_lion"
    BUILD_VAR = "DS_BUILD_FUSED_LION"
    provided_by = "deepspeed.ops.lion.FusedLion"


class FusedLambBuilder(OpBuilder):
    NAME = "fused_lamb"
    BUILD_VAR = "DS_BUILD_FUSED_LAMB"
    provided_by = "the optimizer type 'Lamb' (deepshard.optim.Lamb)"


class AsyncIOBuilder(OpBuilder):
    NAME = "async_io"
    BUILD_VAR = "DS_BUILD_AIO"
    missing = "DeepSpeed's libaio reader/writer; deepshard's NVMe offload uses its own file I/O"


class GDSBuilder(AsyncIOBuilder):
    NAME = "gds"
    BUILD_VAR = "DS_BUILD_GDS"
    missing = "GPUDirect Storage I/O"


class UtilsBuilder(OpBuilder):
    NAME = "utils"
    BUILD_VAR = "DS_BUILD_UTILS"
    missing = "DeepSpeed's compiled flatten/unflatten helpers (torch._utils has the same in Python)"


class PinMemoryBuilder(OpBuilder):
    NAME = "pin_memory"
    BUILD_VAR = "DS_BUILD_PIN_MEMORY"
    missing = "DeepSpeed's pinned-memory allocator (deepshard pins with torch's Tensor.pin_memory)"


class QuantizerBuilder(OpBuilder):
    NAME = "quantizer"
    BUILD_VAR = "DS_BUILD_QUANTIZER"
    missing = "ZeRO++ quantization kernels"


class TransformerBuilder(OpBuilder):
    NAME = "transformer"
    BUILD_VAR = "DS_BUILD_TRANSFORMER"
    missing = "DeepSpeed's fused transformer kernels"


class NotImplementedBuilder(OpBuilder):
    NAME = "deepspeed_not_implemented"
    missing = "an op this accelerator has no implementation of"


ALL_OPS: dict[str, OpBuilder] = {cls.NAME: cls() for cls in (
    CPUAdamBuilder, FusedAdamBuilder, CPUAdagradBuilder, CPULionBuilder, FusedLionBuilder, FusedLambBuilder,
    AsyncIOBuilder, GDSBuilder, UtilsBuilder, PinMemoryBuilder, QuantizerBuilder, TransformerBuilder,
    NotImplementedBuilder)}
"""Every builder by its op name."""


def compatible_ops() -> dict[str, bool]:
    """``deepspeed.ops.__compatible_ops__``: op name -> whether deepshard provides it."""
    return {name: builder.is_compatible() for name, builder in ALL_OPS.items()}


def get_default_compute_capabilities() -> str:
    """The CUDA compute capabilities DeepSpeed builds for by default; nothing is built here."""
    return "6.0;6.1;7.0"


def __getattr__(name: str) -> Any:
    """Builders of ops deepshard has nothing for, and DeepSpeed's build machinery: refused, saying so."""
    from deepshard.compat.aliases import missing_attribute

    raise missing_attribute(__name__, name)
