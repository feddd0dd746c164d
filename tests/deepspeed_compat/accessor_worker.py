"""Build a tiny one-process engine and print every config accessor's value as JSON.

Runs under either library (``--library deepspeed``: the real DeepSpeed in its own venv; ``--library
deepshard``: ``import deepshard as deepspeed``), so both sides answer the same calls on the same config:

    python accessor_worker.py --library deepspeed --case zero2_fp16_offload zero3_offload_param

The last line printed is ``{"case": {"name": value, ...}, ...}``: plain values as they are, dtypes as ``"torch.float16"``,
tuples as lists, config objects as ``{"__object__": {field: value}}`` and a call that raises as
``{"__error__": "TypeName"}``.
"""
from __future__ import annotations

import argparse
import enum
import json
import os
import socket
import sys
from typing import Any

# DeepSpeed 0.19.8's engine methods that only read the config (and the few derived from it) that both
# engines must answer alike; tests/deepspeed_compat/test_engine_accessors.py lists the deliberate differences.
# (swap_tensor_config is left out: DeepSpeed 0.19.8's own raises AttributeError, and so does deepshard's.)
ACCESSORS = (
    "aio_config", "autotp_size", "autotuning_enabled", "autotuning_end_profile_step", "autotuning_metric",
    "autotuning_profile_model_info", "autotuning_start_profile_step", "bf16_master_weights_and_gradients",
    "bf16_optimizer_states", "bfloat16_enabled", "checkpoint_serialization_enabled",
    "checkpoint_tag_validation_enabled", "checkpoint_tag_validation_fail", "checkpoint_writer_enabled",
    "compile_autosp", "compile_autotp", "compile_zero_optimization_stage", "cpuadam_cores_perc",
    "curriculum_learning_config", "curriculum_learning_enabled", "data_efficiency_config",
    "data_efficiency_enabled", "data_sampling_config", "data_sampling_enabled", "dataloader_drop_last",
    "dump_state", "dynamic_loss_scale", "dynamic_loss_scale_args", "flops_profiler_enabled",
    "flops_profiler_module_depth", "flops_profiler_output_file", "flops_profiler_recompute_fwd_factor",
    "flops_profiler_top_modules", "flops_profiler_profile_step", "flops_profiler_detailed", "fp16_auto_cast",
    "fp16_enabled", "fp16_master_weights_and_gradients", "gradient_accumulation_steps", "gradient_clipping",
    "gradient_predivide_factor", "initial_dynamic_scale", "is_deepcompile_enabled", "is_sanity_checks_enabled",
    "load_universal_checkpoint", "log_level", "managed_gradient_accumulation", "memory_breakdown",
    "optimizer_legacy_fusion", "optimizer_name", "optimizer_params", "postscale_gradients", "random_ltd_config",
    "random_ltd_enabled", "scheduler_name", "scheduler_params", "steps_per_print", "super_offload",
    "tensor_parallel_config", "torch_autocast_dtype", "torch_autocast_enabled",
    "train_batch_size", "train_micro_batch_size_per_gpu", "use_node_local_storage", "wall_clock_breakdown",
    "zenflow_config", "zero_allgather_bucket_size", "zero_allgather_partitions", "zero_allgather_sequential",
    "zero_allow_untested_optimizer", "zero_compute_grad_norm", "zero_contiguous_gradients",
    "zero_elastic_checkpoint", "zero_force_ds_cpu_optimizer", "zero_gather_16bit_weights_on_model_save",
    "zero_hpz_partition_size", "zero_ignore_unused_parameters", "zero_legacy_stage1",
    "zero_load_from_fp32_weights", "zero_log_trace_cache_warnings", "zero_max_live_parameters",
    "zero_max_reuse_distance", "zero_model_persistence_threshold", "zero_module_granularity_threshold",
    "zero_multi_rank_bucket_allreduce", "zero_offload_optimizer", "zero_offload_param", "zero_optimization",
    "zero_optimization_stage", "zero_overlap_comm", "zero_param_persistence_threshold",
    "zero_parameter_alignment", "zero_partial_offload", "zero_prefetch_bucket_size",
    "zero_quantized_gradients", "zero_quantized_nontrainable_weights", "zero_quantized_weights",
    "zero_reduce_bucket_size", "zero_reduce_scatter", "zero_round_robin_gradients",
    "zero_save_muon_momentum_buffer_in_memory", "zero_sub_group_size", "zero_cpu_offload",
    "zero_use_cpu_optimizer", "zero_optimization_partition_gradients", "zero_optimization_partition_weights",
    "is_first_weights_partition_group", "zero_nvme_offload_optimizer", "get_data_types", "get_batch_info",
    "get_data_parallel_rank", "get_model_parallel_rank", "get_tensor_parallel_rank", "is_deepcompile_active",
    "uses_parallelization_pass_only",
)
PROPERTIES = ("communication_data_type",)  # attributes, not methods, in DeepSpeed


def case_config(case: str) -> tuple[dict[str, Any], bool]:
    """The config of ``case`` and whether the client passes its own torch optimizer."""
    base: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                            "steps_per_print": 5}
    if case == "zero0_fp32_sched":
        return {**base, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01}},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-3}},
                "wall_clock_breakdown": True, "dataloader_drop_last": True}, False
    if case == "zero1_bf16_clip":
        return {**base, "gradient_accumulation_steps": 4, "gradient_clipping": 0.5, "bf16": {"enabled": True},
                "zero_optimization": {"stage": 1, "reduce_bucket_size": 1000, "allgather_bucket_size": 2000},
                "optimizer": {"type": "AdamW", "params": {"lr": 2e-4}}, "prescale_gradients": True,
                "gradient_predivide_factor": 2.0}, False
    if case == "zero2_fp16_offload":
        return {**base, "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 50,
                                 "hysteresis": 3, "min_loss_scale": 2},
                "communication_data_type": "fp32", "zero_force_ds_cpu_optimizer": False,
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                      "overlap_comm": False, "contiguous_gradients": False,
                                      "reduce_scatter": False, "round_robin_gradients": True}}, True
    if case == "zero3_offload_param":
        return {**base, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.8, 0.9]}},
                "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False},
                                      "sub_group_size": 100000, "stage3_prefetch_bucket_size": 5000,
                                      "stage3_param_persistence_threshold": 10, "stage3_max_live_parameters": 30000,
                                      "stage3_max_reuse_distance": 20000,
                                      "stage3_gather_16bit_weights_on_model_save": True},
                "checkpoint": {"tag_validation": "Fail"}, "memory_breakdown": False}, False
    raise SystemExit(f"unknown case {case!r}")


CASES = ("zero0_fp32_sched", "zero1_bf16_clip", "zero2_fp16_offload", "zero3_offload_param")


def encode(value: Any) -> Any:
    """``value`` as JSON both libraries' answers can be compared in."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return encode(value.value)
    if type(value).__name__ == "dtype":
        return str(value)
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if hasattr(value, "model_dump"):
        return {"__object__": encode(value.model_dump())}
    return {"__repr__": type(value).__name__}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build(case: str) -> Any:
    """A one-process engine of ``case`` under whichever ``deepspeed`` is imported."""
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
    os.environ.setdefault("MASTER_PORT", str(_port()))
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    cfg, client_optimizer = case_config(case)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3) if client_optimizer else None
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=optimizer,
                                      config=cfg)
    return engine


def dump(engine: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ACCESSORS + PROPERTIES:
        try:
            value = getattr(engine, name)
            out[name] = encode(value() if name in ACCESSORS else value)
        except Exception as exc:  # noqa: BLE001 - recorded and compared, not hidden
            out[name] = {"__error__": type(exc).__name__}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--library", choices=("deepspeed", "deepshard"), required=True)
    parser.add_argument("--case", choices=CASES, nargs="+", required=True)
    args = parser.parse_args()
    if args.library == "deepshard":
        import deepshard

        sys.modules["deepspeed"] = deepshard
    print(json.dumps({case: dump(build(case)) for case in args.case}))


if __name__ == "__main__":
    main()
