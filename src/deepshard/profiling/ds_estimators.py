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
    lines = ["Estimated memory needed for params, optim states and gradients for a:",
             f"HW: Setup with {num_nodes} node{'s' if num_nodes > 1 else ''}, "
             f"{num_gpus_per_node} GPU{'s' if num_gpus_per_node > 1 else ''} per node.",
             f"SW: Model with {total_params / 1e6:.0f}M total params"
             + (f", {largest / 1e6:.0f}M largest layer params." if largest is not None else "."),
             "  per CPU  |  per GPU |   Options"]
    return lines


def _row(cpu: float, gpu: float, options: str) -> str:
    return f"  {cpu / GB:7.2f}GB | {gpu / GB:7.2f}GB | {options}"


def estimate_zero2_model_states_mem_needs(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True, additional_buffer_factor: float = 1.5
                                          ) -> tuple[int, int]:
    """``(cpu_bytes, gpu_bytes)`` per process for ZeRO-2 with mixed-precision Adam."""
    gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        return int(total_params * max(4 * gpus, 16) * additional_buffer_factor), int(2 * total_params)
    return (int(total_params * 4 * num_gpus_per_node * additional_buffer_factor),
            int(2 * total_params + 18 * total_params / gpus))


def estimate_zero2_model_states_mem_needs_all_cold(total_params: int, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> str:
    """Print (and return) the ZeRO-2 table for a parameter count, without a model."""
    lines = _header(total_params, num_gpus_per_node, num_nodes)
    for offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes, offload,
                                                         additional_buffer_factor)
        lines.append(_row(cpu, gpu, f"offload_optimizer={'cpu' if offload else 'none'}"))
    text = "\n".join(lines)
    print(text)
    return text


def estimate_zero2_model_states_mem_needs_all_live(model: torch.nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> str:
    """The ZeRO-2 table for ``model`` (its parameters counted once each, ZeRO-3 shards at full size)."""
    return estimate_zero2_model_states_mem_needs_all_cold(unique_param_count(model), num_gpus_per_node, num_nodes,
                                                          additional_buffer_factor)


def estimate_zero3_model_states_mem_needs(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                                          num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                                          zero_init: bool = True, additional_buffer_factor: float = 1.5
                                          ) -> tuple[int, int, int]:
    """``(cpu_bytes, gpu_bytes, largest_layer_bytes)`` per process for ZeRO-3 with mixed-precision Adam."""
    gpus = num_nodes * num_gpus_per_node
    per_node = 1 / num_nodes
    largest = 4 * largest_layer_params
    if cpu_offload and cpu_offload_params:
        gpu, cpu = largest, total_params * 18 * per_node * additional_buffer_factor
    elif cpu_offload:
        gpu = largest + 2 * total_params / gpus
        cpu = total_params * max(4 * num_gpus_per_node, 16 * per_node) * additional_buffer_factor
    else:
        gpu = largest + 18 * total_params / gpus
        params_held = largest_layer_params if zero_init else total_params
        cpu = params_held * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu), int(largest)


def estimate_zero3_model_states_mem_needs_all_cold(total_params: int, largest_layer_params: int,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> str:
    """Print (and return) the ZeRO-3 table for a parameter count and largest layer, without a model."""
    lines = _header(total_params, num_gpus_per_node, num_nodes, largest_layer_params)
    for offload_param, offload_opt in ((True, True), (False, True), (False, False)):
        for zero_init in (True, False):
            if offload_param and not zero_init:
                continue
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total_params, largest_layer_params,
                                                                num_gpus_per_node, num_nodes, offload_opt,
                                                                offload_param, zero_init, additional_buffer_factor)
            lines.append(_row(cpu, gpu, f"offload_param={'cpu' if offload_param else 'none'}, "
                                        f"offload_optimizer={'cpu' if offload_opt else 'none'}, "
                                        f"zero_init={int(zero_init)}"))
    text = "\n".join(lines)
    print(text)
    return text


def estimate_zero3_model_states_mem_needs_all_live(model: torch.nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> str:
    """The ZeRO-3 table for ``model``."""
    return estimate_zero3_model_states_mem_needs_all_cold(unique_param_count(model), _largest_layer_params(model),
                                                          num_gpus_per_node, num_nodes, additional_buffer_factor)
