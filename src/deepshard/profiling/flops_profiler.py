"""The FLOPs profiler with DeepSpeed's names: :class:`FlopsProfiler` and :func:`get_model_profile`.

What differs from DeepSpeed's (on purpose): the backward is *measured* op by op (see
``deepshard.profiling.flop_count``), not assumed to be 2x the forward; tied weights are counted once;
ZeRO-3 sharded parameters are counted at full size; only matmul, convolution and attention FLOPs are
counted (element-wise ops are not, as in torch's ``FlopCounterMode`` and in MFU as usually quoted).

Use it directly::

    prof = FlopsProfiler(model)
    prof.start_profile()
    loss = model(x).sum(); loss.backward()
    prof.stop_profile()
    flops, bwd = prof.get_total_flops(), prof.get_total_backward_flops()
    prof.print_model_profile()
    prof.end_profile()

or through the ``flops_profiler`` config section (the engine profiles global step ``profile_step``).
"""
from __future__ import annotations

import os

import sys
import time
from typing import Any, Callable, Iterable

import torch

from deepshard.profiling.flop_count import FlopCounter, ModuleStats
from deepshard.profiling.profile_report import (ProfileSummary, duration_to_string, flops_to_string,
                                                macs_to_string, number_to_string, params_to_string,
                                                peak_flops_for_device, render)

__all__ = ["FlopsProfiler", "get_model_profile", "flops_to_string", "macs_to_string", "params_to_string",
           "duration_to_string", "number_to_string"]


def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _sync_for(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class FlopsProfiler:
    """Counts FLOPs, MACs, parameters and latency of ``model`` between ``start_profile`` and
    ``stop_profile``. ``ds_engine`` (a deepshard engine) adds its batch size, world size and step timers
    to the printed summary. ``peak_tflops`` (deepshard): the device's peak for the MFU line, where the
    device is not one of the known GPUs (or to quote MFU against another peak, e.g. a CPU's)."""

    def __init__(self, model: torch.nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0,
                 peak_tflops: float | None = None) -> None:
        self.model = model
        self.peak_tflops = peak_tflops
        self.ds_engine = ds_engine
        # Accepted for DeepSpeed compatibility: recomputation is measured here, so no factor is applied.
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self.func_patched = False  # DeepSpeed's attribute; nothing is patched here
        self._counter: FlopCounter | None = None
        self.backward_duration = 0.0
        self.step_duration = 0.0
        self.samples = 0

    # ------------------------------------------------------------------ window
    def start_profile(self, ignore_list: Iterable[type] | None = None) -> None:
        """Start counting (counts restart from zero). ``ignore_list``: module classes left out of the table."""
        device = _device_of(self.model)
        if self._counter is None:
            self._counter = FlopCounter(self.model, _sync_for(device), tuple(ignore_list or ()))
        self.reset_profile()
        self._counter.start()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting; the counts stay readable until ``end_profile``."""
        if self._counter is not None:
            self._counter.stop()
        self.started = False

    def reset_profile(self) -> None:
        if self._counter is not None:
            self._counter.reset()
        self.backward_duration = self.step_duration = 0.0
        self.samples = 0

    def end_profile(self) -> None:
        """Stop and drop everything the profiler attached or measured."""
        self.stop_profile()
        self._counter = None

    # ------------------------------------------------------------------ totals
    def _root(self) -> ModuleStats:
        if self._counter is None:
            raise RuntimeError("the profiler has no counts: call start_profile(), run the model, then read them")
        return self._counter.stats[""]

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward FLOPs counted in the window (DeepSpeed's meaning of the total)."""
        flops = self._root().fwd_flops
        return flops_to_string(flops) if as_string else flops

    def get_total_backward_flops(self, as_string: bool = False) -> int | str:
        """Backward FLOPs, measured (0 if no backward ran in the window)."""
        flops = self._root().bwd_flops
        return flops_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Forward multiply-accumulates (FLOPs / 2)."""
        macs = self._root().fwd_macs
        return macs_to_string(macs) if as_string else macs

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters at full size (ZeRO-3 shards included at full size), tied weights once."""
        params = self._root().params
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Forward wall time of the model in the window (seconds)."""
        seconds = self._root().fwd_latency
        return duration_to_string(seconds) if as_string else seconds

    def module_stats(self) -> list[ModuleStats]:
        """Per-module figures, in the model's ``named_modules`` order (the root, name ``""``, first)."""
        self._root()
        return list(self._counter.stats.values())  # type: ignore[union-attr]

    # ------------------------------------------------------------------ report
    def summary(self) -> ProfileSummary:
        root = self._root()
        engine = self.ds_engine
        summary = ProfileSummary(params=root.params, fwd_flops=root.fwd_flops, bwd_flops=root.bwd_flops,
                                 fwd_latency=root.fwd_latency, bwd_latency=self.backward_duration,
                                 step_latency=self.step_duration, samples=self.samples,
                                 peak_flops=(self.peak_tflops * 1e12 if self.peak_tflops
                                             else peak_flops_for_device(_device_of(self.model))))
        if engine is not None:
            summary.world_size = int(getattr(engine, "world_size", 1))
            summary.extra = [("data parallel size", str(engine.dp_world_size)),
                             ("micro batch per process", str(engine.train_micro_batch_size_per_gpu())),
                             ("accumulation steps in window", str(engine.gradient_accumulation_steps()))]
        return summary

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> str:
        """Print the report (to ``output_file`` when given, else stdout) and return its text."""
        text = render(self.summary(), self.module_stats(), module_depth, top_modules, detailed, profile_step)
        if output_file:
            os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
            with open(output_file, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
        else:
            print(text, file=sys.stdout, flush=True)
        return text


def _inputs(model: torch.nn.Module, input_shape: tuple | None, args: list, kwargs: dict) -> tuple[list, dict]:
    if input_shape is None:
        return list(args), dict(kwargs)
    if args:
        raise ValueError("get_model_profile: give input_shape or args, not both")
    if not isinstance(input_shape, tuple) or not input_shape:
        raise ValueError(f"input_shape must be a non-empty tuple of ints, got {input_shape!r}")
    p = next(model.parameters(), None)
    dtype = p.dtype if p is not None and p.is_floating_point() else torch.float32
    return [torch.ones(input_shape, dtype=dtype, device=_device_of(model))], dict(kwargs)


def _loss_of(output: Any) -> torch.Tensor:
    if torch.is_tensor(output):
        return output if output.numel() == 1 else output.float().sum()
    loss = getattr(output, "loss", None)
    if torch.is_tensor(loss):
        return loss
    if isinstance(output, (tuple, list)) and output and torch.is_tensor(output[0]):
        return _loss_of(output[0])
    raise ValueError(f"mode='train' needs a tensor output (or one with .loss) to call backward on, "
                     f"got {type(output).__name__}")


def _run_once(model: torch.nn.Module, args: list, kwargs: dict, mode: str, prof: FlopsProfiler | None) -> None:
    if mode == "forward":
        with torch.no_grad():
            model(*args, **kwargs)
        return
    loss = _loss_of(model(*args, **kwargs))
    sync = _sync_for(_device_of(model))
    sync()
    start = time.perf_counter()
    loss.backward()
    sync()
    if prof is not None:
        prof.backward_duration += time.perf_counter() - start
    model.zero_grad(set_to_none=True)


def get_model_profile(model: torch.nn.Module, input_shape: tuple | None = None, args: list | None = None,
                      kwargs: dict | None = None, print_profile: bool = True, detailed: bool = True,
                      module_depth: int = -1, top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: str | None = None, ignore_modules: list[type] | None = None,
                      mode: str = "forward") -> tuple[Any, Any, Any]:
    """Profile one call of ``model`` and return ``(flops, macs, params)`` (strings when ``as_string``).

    ``mode="forward"`` (DeepSpeed's default) runs the forward under ``torch.no_grad``; ``mode="train"``
    also runs a backward of the output (summed if not a scalar, or its ``.loss``) and then the returned
    flops and macs cover forward *and* measured backward. ``warm_up`` calls run first, uncounted.
    """
    if mode not in ("forward", "train"):
        raise ValueError(f"get_model_profile(mode={mode!r}): use 'forward' or 'train' ('generate' is not "
                         "supported; profile model.generate with FlopsProfiler directly)")
    call_args, call_kwargs = _inputs(model, input_shape, args or [], kwargs or {})
    for _ in range(warm_up):
        _run_once(model, call_args, call_kwargs, mode, None)
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=ignore_modules)
    _run_once(model, call_args, call_kwargs, mode, prof)
    prof.stop_profile()
    flops = int(prof.get_total_flops()) + (int(prof.get_total_backward_flops()) if mode == "train" else 0)
    params = int(prof.get_total_params())
    if print_profile:
        prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                 detailed=detailed, output_file=output_file)
    prof.end_profile()
    if as_string:
        return flops_to_string(flops), macs_to_string(flops // 2), params_to_string(params)
    return flops, flops // 2, params
