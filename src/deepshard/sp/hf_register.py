"""``UlyssesSPAttentionHF.register_with_transformers``: the grid, the wrapper in transformers' attention
registry, and the mpu (DeepSpeed's ``parallel_state_sp`` names) that ``initialize(mpu=...)`` takes."""
from __future__ import annotations

import re
from typing import Any, Optional

import torch

from deepshard.sp.api import SequenceParallel
from deepshard.topology import ParallelDims, Topology
from deepshard.utils.groups import remember_grid
from deepshard.utils.logging import logger

_HUB_KERNEL = re.compile(r"^[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?$")


class SequenceParallelMpu:
    """The mpu ``register_with_transformers`` returns: DeepSpeed's ``parallel_state_sp`` functions over a
    deepshard grid (which ``initialize`` takes as it is)."""

    def __init__(self, topology: Topology, sequence_parallel: SequenceParallel) -> None:
        self.deepshard_topology = topology
        self.deepshard_sequence_parallel = sequence_parallel

    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        if sequence_parallel_size != self.deepshard_topology.dims.sp:
            raise ValueError(f"this mpu was built for sequence_parallel_size={self.deepshard_topology.dims.sp}")

    def get_sequence_parallel_group(self) -> Any:
        return self.deepshard_topology.sp.group

    def get_sequence_parallel_world_size(self) -> int:
        return self.deepshard_topology.sp.size

    def get_sequence_parallel_rank(self) -> int:
        return self.deepshard_topology.sp.rank

    def get_sequence_data_parallel_group(self) -> Any:
        return self.deepshard_topology.seq_dp.group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.deepshard_topology.seq_dp.size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.deepshard_topology.seq_dp.rank

    # DeepSpeed aliases model parallel to sequence parallel in this mpu
    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank


def _model_config(model_name_or_path: Any, core_attn_implementation: str) -> Any:
    if hasattr(model_name_or_path, "config"):
        config = model_name_or_path.config
        loaded = getattr(config, "_attn_implementation", None)
        if loaded is not None and loaded != core_attn_implementation:
            raise ValueError(f"core_attn_implementation={core_attn_implementation!r} but the model was loaded with "
                             f"attn_implementation={loaded!r}; give both the same value")
        return config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_name_or_path)


def _core_attention(name: str) -> Any:
    """The attention function to wrap; None for ``eager`` (the wrapper computes it itself)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in ("eager", "paged|eager"):
        return None
    if _HUB_KERNEL.match(name):
        from transformers.modeling_flash_attention_utils import lazy_import_flash_attention

        lazy_import_flash_attention(name)
    if name not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"core_attn_implementation={name!r} is not a transformers attention implementation; "
                         f"choose one of {['eager', *ALL_ATTENTION_FUNCTIONS.valid_keys()]}")
    return ALL_ATTENTION_FUNCTIONS[name]


def register(cls: Any, model_name_or_path: Any, core_attn_implementation: str, sequence_parallel_size: int,
             micro_batch_size: int, seq_length: Optional[int], seq_length_is_variable: bool,
             disable_in_eval: bool, mode: str = "ulysses", ulysses_size: Optional[int] = None,
             load_balance: bool = True) -> Optional[SequenceParallelMpu]:
    if sequence_parallel_size == 1:
        return None
    if not seq_length_is_variable and seq_length is None:
        raise ValueError("register_with_transformers: give seq_length=<the fixed length> or seq_length_is_variable=True")
    import torch.distributed as dist

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not dist.is_initialized():
        from deepshard.distributed import init_distributed

        init_distributed(verbose=False)
    config = _model_config(model_name_or_path, core_attn_implementation).get_text_config()
    core = _core_attention(core_attn_implementation)
    topology = Topology.build(ParallelDims.for_world(dist.get_world_size(), sp=sequence_parallel_size))
    if mode not in ("ulysses", "ring", "hybrid"):
        raise ValueError(f"register_with_transformers: sequence_parallel_mode={mode!r}; use 'ulysses', 'ring' or "
                         "'hybrid' (with ulysses_size)")
    sequence_parallel = SequenceParallel.build(topology, mode, ulysses_size, load_balance)  # type: ignore[arg-type]
    local = None if seq_length_is_variable else -(-int(seq_length) // sequence_parallel_size)  # type: ignore[arg-type]
    heads = config.num_attention_heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // heads
    uattn = cls(attn=core, batch_size=micro_batch_size, attn_head_count=heads, attn_head_size=head_size,
                kv_head_count=getattr(config, "num_key_value_heads", heads), num_hidden_layers=config.num_hidden_layers,
                process_group=topology.sp, seq_length_is_variable=seq_length_is_variable, local_seq_length=local,
                global_seq_length=None if local is None else local * sequence_parallel_size,
                disable_in_eval=disable_in_eval)
    uattn.core_attn_implementation = core_attn_implementation
    uattn.sequence_parallel = sequence_parallel

    def uattn_wrapper(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        # the mask transformers built is for this rank's slice only: causality comes from the whole sequence
        return uattn(module, query, key, value, None, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = uattn_wrapper
    remember_grid(topology, sequence_parallel)
    if topology.rank == 0:
        logger.info("sequence parallelism (%s): %d ranks per sequence, %s attention, %s", mode,
                    sequence_parallel_size, core_attn_implementation, topology.dims)
    return SequenceParallelMpu(topology, sequence_parallel)
