"""The tables of DeepSpeed's engine accessor methods that read one config value or give a fixed answer.

``tools/gen_engine_accessors.py`` writes one real method per entry into ``engine_accessors_generated.py``
(the ``GeneratedAccessors`` mixin of the engine), so readers and type checkers see every method; a unit test
regenerates that file and checks each path against ``DeepShardConfig``'s fields. Add an accessor here, then
run the generator.
"""
from __future__ import annotations

from typing import Any

# name -> (path in DeepShardConfig, return type as written in the generated source): the method returns
# that config value unchanged
CONFIG_READS: dict[str, tuple[str, str]] = {
    "train_batch_size": ("train_batch_size", "int"),
    "train_micro_batch_size_per_gpu": ("train_micro_batch_size_per_gpu", "int"),
    "gradient_accumulation_steps": ("gradient_accumulation_steps", "int"),
    "managed_gradient_accumulation": ("managed_gradient_accumulation", "bool"),
    "gradient_clipping": ("gradient_clipping", "float"),
    "gradient_predivide_factor": ("gradient_predivide_factor", "float"),
    "steps_per_print": ("steps_per_print", "Optional[int]"),
    "wall_clock_breakdown": ("wall_clock_breakdown", "bool"),
    "memory_breakdown": ("memory_breakdown", "bool"),
    "dump_state": ("dump_state", "bool"),
    "dataloader_drop_last": ("dataloader_drop_last", "bool"),
    "zero_allow_untested_optimizer": ("zero_allow_untested_optimizer", "bool"),
    "zero_force_ds_cpu_optimizer": ("zero_force_ds_cpu_optimizer", "bool"),
    "fp16_enabled": ("fp16.enabled", "bool"),
    "fp16_auto_cast": ("fp16.auto_cast", "bool"),
    "fp16_master_weights_and_gradients": ("fp16.fp16_master_weights_and_grads", "bool"),
    "bfloat16_enabled": ("bf16.enabled", "bool"),
    "bf16_master_weights_and_gradients": ("bf16.bf16_master_weights_and_grads", "bool"),
    "bf16_optimizer_states": ("bf16.bf16_optimizer_states", "bool"),
    "torch_autocast_enabled": ("torch_autocast.enabled", "bool"),
    "flops_profiler_module_depth": ("flops_profiler.module_depth", "int"),
    "flops_profiler_top_modules": ("flops_profiler.top_modules", "int"),
    "flops_profiler_output_file": ("flops_profiler.output_file", "Optional[str]"),
    "flops_profiler_recompute_fwd_factor": ("flops_profiler.recompute_fwd_factor", "float"),
    "checkpoint_serialization_enabled": ("checkpoint.serialization", "bool"),
    "load_universal_checkpoint": ("checkpoint.load_universal", "bool"),
    "use_node_local_storage": ("checkpoint.use_node_local_storage", "bool"),
    "zero_optimization_stage": ("zero_optimization.stage", "int"),
    "zero_contiguous_gradients": ("zero_optimization.contiguous_gradients", "bool"),
    "zero_reduce_scatter": ("zero_optimization.reduce_scatter", "bool"),
    "zero_overlap_comm": ("zero_optimization.overlap_comm", "bool"),
    "zero_reduce_bucket_size": ("zero_optimization.reduce_bucket_size", "int"),
    "zero_allgather_partitions": ("zero_optimization.allgather_partitions", "bool"),
    "zero_allgather_bucket_size": ("zero_optimization.allgather_bucket_size", "int"),
    "zero_multi_rank_bucket_allreduce": ("zero_optimization.use_multi_rank_bucket_allreduce", "bool"),
    "zero_load_from_fp32_weights": ("zero_optimization.load_from_fp32_weights", "bool"),
    "zero_elastic_checkpoint": ("zero_optimization.elastic_checkpoint", "bool"),
    "zero_sub_group_size": ("zero_optimization.sub_group_size", "int"),
    "zero_round_robin_gradients": ("zero_optimization.round_robin_gradients", "bool"),
    "zero_ignore_unused_parameters": ("zero_optimization.ignore_unused_parameters", "bool"),
    "zero_prefetch_bucket_size": ("zero_optimization.prefetch_bucket_size", "Optional[int]"),
    "zero_param_persistence_threshold": ("zero_optimization.param_persistence_threshold", "int"),
    "zero_model_persistence_threshold": ("zero_optimization.model_persistence_threshold", "int"),
    "zero_max_live_parameters": ("zero_optimization.max_live_parameters", "int"),
    "zero_max_reuse_distance": ("zero_optimization.max_reuse_distance", "int"),
    "zero_gather_16bit_weights_on_model_save": ("zero_optimization.gather_16bit_weights_on_model_save", "bool"),
    "zero_module_granularity_threshold": ("zero_optimization.module_granularity_threshold", "int"),
    "zero_allgather_sequential": ("zero_optimization.allgather_sequential", "bool"),
    "zero_log_trace_cache_warnings": ("zero_optimization.log_trace_cache_warnings", "bool"),
    "is_sanity_checks_enabled": ("zero_optimization.enable_sanity_checks", "bool"),
    "zero_save_muon_momentum_buffer_in_memory": ("zero_optimization.save_muon_momentum_buffer_in_memory", "bool"),
    "zero_hpz_partition_size": ("zero_optimization.zero_hpz_partition_size", "int"),
    "zero_quantized_weights": ("zero_optimization.zero_quantized_weights", "bool"),
    "zero_quantized_nontrainable_weights": ("zero_optimization.zero_quantized_nontrainable_weights", "bool"),
    "zero_quantized_gradients": ("zero_optimization.zero_quantized_gradients", "bool"),
    "zero_offload_optimizer": ("zero_optimization.offload_optimizer", "Optional[OffloadOptimizerConfig]"),
    "zero_offload_param": ("zero_optimization.offload_param", "Optional[OffloadParamConfig]"),
}

# features deepshard does not implement (their config sections are refused when turned on): DeepSpeed's answer
# while the feature is off
DISABLED_FEATURES: dict[str, Any] = {
    "random_ltd_enabled": False,
    "curriculum_learning_enabled": False,
    "data_efficiency_enabled": False,
    "data_sampling_enabled": False,
    "is_deepcompile_enabled": False,
    "is_deepcompile_active": False,
    "uses_parallelization_pass_only": False,
    "compile_zero_optimization_stage": False,
    "compile_autosp": False,
    "compile_autotp": False,
    "zenflow_config": None,
    "zero_legacy_stage1": False,
    "zero_parameter_alignment": False,
    "zero_nvme_offload_optimizer": False,
    "optimizer_legacy_fusion": False,
}
