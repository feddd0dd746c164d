"""DeepSpeed's model-state memory estimators, by name, output and formula (model states only).

``P`` is the parameter count (tied weights once), ``G`` the number of devices, ``L`` the largest layer's
bytes (4 bytes per parameter of the largest module with parameters of its own). These formulas leave
out activations, communication buffers and transients; :mod:`deepshard.profiling.memory_estimator`
estimates the whole run.
"""
from __future__ import annotations

import torch

from deepshard.profiling.flop_count import full_numel, unique_param_count

GB = 1024 ** 3


def _largest_layer_params(model: torch.nn.Module) -> int:
    return max((sum(full_numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0)


def _header(total_params: int, num_gpus_per_node: int, num_nodes: int, largest: int | None = None) -> list[str]:
    """DeepSpeed's three header lines and column titles (parameter counts truncated to whole millions)."""
    model = f"SW: Model with {int(total_params / 1e6)}M total params"
    model += f", {int(largest / 1e6)}M largest layer params." if largest is not None else "."
    return ["Estimated memory needed for params, optim states and gradients for a:",
            f"HW: Setup with {num_nodes} {'nodes' if num_nodes > 1 else 'node'}, {num_gpus_per_node} "
            f"{'GPUs' if num_gpus_per_node > 1 else 'GPU'} per node.",
            model,
            "  per CPU  |  per GPU |   Options"]


def _row(cpu: float, gpu: float, options: str) -> str:
    return f" {cpu / GB:7.2f}GB | {gpu / GB:6.2f}GB | {options}"


def _device(offloaded: bool) -> str:
    """An option's device as DeepSpeed prints it: the offload enum formatted to width 4, or ``none``."""
    from deepshard.zero.offload_config import OffloadDeviceEnum

    return f"{OffloadDeviceEnum.cpu:4}" if offloaded else "none"


def _emit(lines: list[str]) -> str:
    text = "\n".join(lines)
    print(text)
    return text


def estimate_zero2_model_states_mem_needs(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True, additional_buffer_factor: float = 1.5
                                          ) -> tuple[int, int]:
    """``(cpu_bytes, gpu_bytes)`` per process for ZeRO-2 with mixed-precision Adam: 2 bytes of 16-bit
    parameters on the device, plus 18 bytes a parameter (16-bit and fp32 gradients, fp32 master, Adam's two
    moments) split over the devices, or kept on the CPU when the optimizer is offloaded."""
    gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        return int(total_params * max(4 * gpus, 16) * additional_buffer_factor), int(2 * total_params)
    return (int(total_params * 4 * num_gpus_per_node * additional_buffer_factor),
            int(2 * total_params + int(18 * total_params / gpus)))


def estimate_zero2_model_states_mem_needs_all_cold(total_params: int, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> str:
    """Print (and return) DeepSpeed's ZeRO-2 table for a parameter count, without a model."""
    lines = _header(total_params, num_gpus_per_node, num_nodes)
    for offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes, offload,
                                                         additional_buffer_factor)
        lines.append(_row(cpu, gpu, f"offload_optimizer={_device(offload)}"))
    return _emit(lines)


def estimate_zero2_model_states_mem_needs_all_live(model: torch.nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> str:
    """The ZeRO-2 table for ``model`` (its parameters counted once each, ZeRO-3 shards at full size)."""
    return estimate_zero2_model_states_mem_needs_all_cold(unique_param_count(model), num_gpus_per_node, num_nodes,
                                                          additional_buffer_factor)


def estimate_zero3_model_states_mem_needs(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                                          num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                                          zero_init: bool = True, additional_buffer_factor: float = 1.5
                                          ) -> tuple[int, int, int]:
    """``(cpu_bytes, gpu_bytes, largest_layer_bytes)`` per process for ZeRO-3 with mixed-precision Adam.

    The device always holds the largest layer gathered (4 bytes a parameter). Without zero_init every
    process of a node first builds the whole model on the CPU (4 bytes a parameter each), which can exceed
    the offloaded states' share of the node's CPU memory; ``cpu_offload_params`` without ``cpu_offload`` is
    not a setting (parameters are only offloaded with the optimizer)."""
    gpus = num_nodes * num_gpus_per_node
    node_share = 1 / num_nodes
    largest = 4 * largest_layer_params
    whole_models = 4 * num_gpus_per_node
    if cpu_offload:  # the products in DeepSpeed's order, so the rounding is the same
        per_param = 18 if cpu_offload_params else 16
        gpu = largest if cpu_offload_params else largest + int(2 * total_params / gpus)
        if zero_init:
            cpu = total_params * per_param * node_share
        else:
            cpu = total_params * max(whole_models, per_param * node_share)
    else:
        gpu = largest + int(18 * total_params / gpus)
        cpu = (largest_layer_params if zero_init else total_params) * whole_models
    return int(cpu * additional_buffer_factor), int(gpu), int(largest)


_ZERO3_ROWS = ((True, True), (True, False), (False, False))
"""(offload_optimizer, offload_param) in DeepSpeed's order; each with zero_init 1 then 0."""


def estimate_zero3_model_states_mem_needs_all_cold(total_params: int, largest_layer_params: int,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> str:
    """Print (and return) DeepSpeed's ZeRO-3 table for a parameter count and largest layer, without a model."""
    lines = _header(total_params, num_gpus_per_node, num_nodes, largest_layer_params)
    for offload_opt, offload_param in _ZERO3_ROWS:
        for zero_init in (True, False):
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total_params, largest_layer_params,
                                                                num_gpus_per_node, num_nodes, offload_opt,
                                                                offload_param, zero_init, additional_buffer_factor)
            lines.append(_row(cpu, gpu, f"offload_param={_device(offload_param)}, "
                                        f"offload_optimizer={_device(offload_opt)}, zero_init={int(zero_init)}"))
    return _emit(lines)


def estimate_zero3_model_states_mem_needs_all_live(model: torch.nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> str:
    """The ZeRO-3 table for ``model``."""
    return estimate_zero3_model_states_mem_needs_all_cold(unique_param_count(model), _largest_layer_params(model),
                                                          num_gpus_per_node, num_nodes, additional_buffer_factor)
