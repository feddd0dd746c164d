"""Which deepshard module answers for each ``deepspeed.*`` module name.

A name resolves through the longest matching prefix of :data:`RENAMED` (``deepspeed.X.Y`` ->
``deepshard.X.Y`` by default); a prefix in :data:`MISSING` raises an ImportError that names the DeepSpeed
feature deepshard lacks.
"""
from __future__ import annotations

RENAMED: dict[str, str] = {
    "deepspeed": "deepshard",
    "deepspeed.runtime.engine": "deepshard.engine",
    "deepspeed.runtime.zero": "deepshard.zero",
    "deepspeed.runtime.zero.partition_parameters": "deepshard.compat.partition_parameters",
    "deepspeed.runtime.config": "deepshard.compat.runtime_config",
    "deepspeed.runtime.zero.stage3": "deepshard.compat.zero_stage3",
    "deepspeed.runtime.zero.parameter_offload": "deepshard.zero.stage3.param_dict",
    "deepspeed.runtime.zero.stage_1_and_2": "deepshard.compat.zero_stage_1_and_2",
    "deepspeed.runtime.dataloader": "deepshard.data",
    "deepspeed.runtime.activation_checkpointing.checkpointing": "deepshard.checkpointing",
    "deepspeed.accelerator.real_accelerator": "deepshard.accelerator",
    "deepspeed.env_report": "deepshard.utils.env_report",
    "deepspeed.runtime.activation_checkpointing": "deepshard.checkpointing",
    "deepspeed.checkpoint.utils": "deepshard.compat.checkpoint_utils",
    "deepspeed.checkpoint.constants": "deepshard.checkpoint.deepspeed_format.constants",
    "deepspeed.checkpoint.deepspeed_checkpoint": "deepshard.checkpoint.deepspeed_format.megatron_checkpoint",
    "deepspeed.checkpoint.zero_checkpoint": "deepshard.checkpoint.deepspeed_format.zero_files",
    "deepspeed.checkpoint.reshape_meg_2d": "deepshard.checkpoint.deepspeed_format.rank_maps",
    "deepspeed.checkpoint.reshape_3d_utils": "deepshard.checkpoint.deepspeed_format.megatron_folder",
    "deepspeed.checkpoint.reshape_utils": "deepshard.checkpoint.deepspeed_format.megatron_folder",
    "deepspeed.checkpoint.ds_to_universal": "deepshard.compat.ds_to_universal",
    "deepspeed.profiling": "deepshard.profiling",
    "deepspeed.runtime.pipe": "deepshard.pipe",
    "deepspeed.runtime.pipe.topology": "deepshard.pipe.grid",
    "deepspeed.runtime.pipe.schedule": "deepshard.pipe.instructions",
    "deepspeed.utils.torch": "deepshard.utils.torch_version",
    "deepspeed.runtime.base_optimizer": "deepshard.compat.ds_optimizers",
    "deepspeed.runtime.bf16_optimizer": "deepshard.compat.ds_optimizers",
    "deepspeed.runtime.fp16": "deepshard.precision",
    "deepspeed.runtime.fp16.fused_optimizer": "deepshard.compat.ds_optimizers",
    "deepspeed.runtime.fp16.unfused_optimizer": "deepshard.compat.ds_optimizers",
    "deepspeed.runtime.sequence_parallel": "deepshard.sp",
    "deepspeed.runtime.sequence_parallel.ulysses_sp": "deepshard.sp.hf",
    "deepspeed.sequence": "deepshard.sp",
    "deepspeed.sequence.layer": "deepshard.sp.ulysses",
    "deepspeed.moe.sharded_moe": "deepshard.moe.sharded_moe",
    "deepspeed.launcher.multinode_runner": "deepshard.compat.multinode_runner",
    "deepspeed.module_inject": "deepshard.compat.module_inject",
    "deepspeed.module_inject.auto_ep_layer": "deepshard.moe.autoep_layer",
}
"""DeepSpeed module path -> the deepshard module that implements it (where the paths differ). A path listed
here exactly is provided even under a prefix of :data:`MISSING` (``deepspeed.module_inject.auto_ep_layer``)."""

MISSING: dict[str, str] = {
    "deepspeed.moe.mappings": "the token drop/gather around the all-to-all for experts under Megatron-style tensor "
                              "parallelism (deepshard's MoE layers run without an mpu)",
    "deepspeed.runtime.torch_autocast": "training under torch.autocast (the config's torch_autocast section); "
                                        "train in 16 bits with the bf16 / fp16 sections instead",
    "deepspeed.runtime.data_pipeline": "the data-efficiency pipeline (curriculum learning, random-LTD, data "
                                       "sampling); feed your own DataLoader",
    "deepspeed.runtime.domino": "Domino tensor-parallel overlap (deepshard's tensor parallelism is "
                                "deepshard.tp / the config's tensor_parallel section)",
    "deepspeed.runtime.state_dict_factory": "Megatron checkpoint loading for inference",
    "deepspeed.ops.sparse_attention": "block-sparse attention kernels",
    "deepspeed.ops.transformer": "DeepSpeed's fused transformer kernels",
    "deepspeed.inference": "the inference engine",
    "deepspeed.module_inject": "kernel injection for inference",
    "deepspeed.compression": "compression training",
    "deepspeed.autotuning": "DeepSpeed's autotuner module API (deepshard's autotuner is the launcher's "
                            "--autotuning tune|run and deepshard.autotuning)",
    "deepspeed.elasticity": "elastic training",
}
"""DeepSpeed module paths deepshard has no counterpart for, and what they are."""


REFUSED_NAMES: dict[str, str] = {
    "deepspeed.init_inference": "the inference engine; for inference run the model under torch (or "
                                "transformers' generate), or use the real DeepSpeed",
    "deepspeed.InferenceEngine": "the inference engine; use the real DeepSpeed for it",
    "deepspeed.DeepSpeedTransformerLayer": "DeepSpeed's fused transformer kernel; use a plain PyTorch layer "
                                           "(torch.nn.TransformerEncoderLayer) or the real DeepSpeed",
    "deepspeed.DeepSpeedTransformerConfig": "DeepSpeed's fused transformer kernel; use a plain PyTorch layer "
                                            "(torch.nn.TransformerEncoderLayer) or the real DeepSpeed",
    "deepspeed.replace_transformer_layer": "kernel injection for inference; use the real DeepSpeed for it",
    "deepspeed.runtime.utils.PartitionedTensor": "DeepSpeed's partitioned pipeline activations (deepshard's "
                                                 "pipeline sends whole activations); use the real DeepSpeed for it",
    "deepspeed.runtime.config.ONEBIT_LAMB_OPTIMIZER": "1-bit LAMB, removed from DeepSpeed 0.19 (the name is gone "
                                                      "there too); use optimizer type 'Lamb' or 'OneBitAdam'",
    "deepspeed.runtime.config.ONEBIT_ADAM_OPTIMIZER": "a name removed from DeepSpeed 0.19's config module; "
                                                      "write the optimizer type 'OneBitAdam' in the config",
    "deepspeed.checkpoint.UNIVERSAL_CHECKPOINT_INFO": "DeepSpeed's universal-checkpoint metadata; leave it out "
                                                      "and use deepshard's own checkpoints instead (they resume "
                                                      "on any layout without a conversion)",
}
REFUSED_NAMES["deepspeed.comm.CCLBackend"] = (
    "DeepSpeed's Intel oneCCL communication backend; deepshard communicates through torch.distributed "
    "(deepspeed.comm.TorchBackend), use that instead")
_CHECKPOINTING = ("activation checkpointing's module-level setup; use the config's activation_checkpointing "
                  "section and deepspeed.checkpointing.checkpoint(fn, *args) instead (tensor-parallel dropout "
                  "streams are deepshard.tp.random's)")
for _name in ("get_cuda_rng_tracker", "model_parallel_cuda_manual_seed",
              "model_parallel_reconfigure_tp_seed"):
    REFUSED_NAMES[f"deepspeed.checkpointing.{_name}"] = _CHECKPOINTING
    REFUSED_NAMES[f"deepspeed.runtime.activation_checkpointing.checkpointing.{_name}"] = _CHECKPOINTING
"""Names inside modules deepshard does provide that it refuses, ``deepspeed.X.name`` -> why and what to use
(an AttributeError carries it, so ``hasattr`` stays False)."""

_UNIVERSAL = ("VOCABULARY_PARAMETER_PATTERNS", "PIPELINE_REPLICATED_PARAMETER_PATTERNS",
              "TP_REPLICATED_PARAMETER_PATTERNS", "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS",
              "PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0", "UNIVERSAL_CHECKPOINT_VERSION_KEY",
              "UNIVERSAL_CHECKPOINT_VERSION_VALUE", "ORIGINAL_VOCAB_SIZE", "PADDED_VOCAB_SIZE")
for _name in _UNIVERSAL:
    REFUSED_NAMES[f"deepspeed.checkpoint.{_name}"] = REFUSED_NAMES["deepspeed.checkpoint.UNIVERSAL_CHECKPOINT_INFO"]


def refusal(fullname: str) -> str:
    """The AttributeError message for a ``deepspeed`` name deepshard lacks, or for its ``deepshard.``
    spelling: why, and what to use."""
    ds_name = "deepspeed" + fullname[len("deepshard"):] if fullname.startswith("deepshard.") else fullname
    who = "deepshard" if ds_name != fullname else "this 'deepspeed' (deepshard, via deepshard.compat)"
    if ds_name in REFUSED_NAMES:
        return f"{fullname} is not provided by {who}: it is {REFUSED_NAMES[ds_name]}"
    feature = next((text for prefix, text in MISSING.items() if ds_name.startswith(prefix + ".")), None)
    if feature:  # a name inside a package deepshard provides only a part of (deepspeed.module_inject)
        return f"{fullname} is not provided by {who}: it is {feature}; use the real DeepSpeed for it"
    return f"{fullname} is not provided by {who}; use the real DeepSpeed for it"


def missing_attribute(module_name: str, name: str) -> AttributeError:
    """What a deepshard module's ``__getattr__`` raises for a name it lacks: the refusal of
    :data:`REFUSED_NAMES` (why, and what to use) when the DeepSpeed spelling of the name is listed there."""
    if name.startswith("__") and name.endswith("__"):
        return AttributeError(f"module {module_name!r} has no attribute {name!r}")
    return AttributeError(refusal(f"{module_name}.{name}"), name=name)


def target_of(fullname: str, shown: str | None = None) -> str:
    """The deepshard module name for the DeepSpeed module ``fullname``; raises ImportError for a
    feature deepshard does not implement (an ImportError, not ModuleNotFoundError, so that the message
    reaches the user through ``from deepspeed.x import y`` too). ``shown`` is the name the user imported
    when it is not ``fullname`` (the ``deepshard.X`` spelling of ``deepspeed.X``)."""
    for prefix, feature in () if fullname in RENAMED else MISSING.items():  # a RENAMED path wins over MISSING
        if fullname == prefix or fullname.startswith(prefix + "."):
            who = ("this 'deepspeed' is deepshard (deepshard.compat), which" if shown is None
                   else "deepshard")
            raise ImportError(f"No module named {shown or fullname!r}: {who} does not implement {feature}; use "
                              "the real DeepSpeed for it", name=shown or fullname)
    parts = fullname.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in RENAMED:
            return ".".join([RENAMED[prefix], *parts[cut:]])
    raise ModuleNotFoundError(f"{fullname!r} is not a deepspeed module name", name=fullname)
