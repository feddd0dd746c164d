"""Checkpoint files: tensors in safetensors, metadata in JSON, atomic saves, verified loads."""
from typing import Any

from deepshard.checkpoint.io import (
    LATEST_NAME,
    MANIFEST_NAME,
    CheckpointError,
    commit_staging,
    file_digest,
    load_json,
    load_tensors,
    read_latest,
    recover_tag,
    save_json,
    save_tensors,
    staging_dir,
    validate_tag,
    verify_manifest,
    write_latest,
    write_manifest,
)
from deepshard.checkpoint.state import flatten_state, unflatten_state

# DeepSpeed's readers of Megatron-DeepSpeed 3D folders (deepspeed.checkpoint's names; docs/checkpoints.md)
from deepshard.checkpoint.deepspeed_format.megatron_checkpoint import DeepSpeedCheckpoint  # noqa: E402
from deepshard.checkpoint.deepspeed_format.megatron_folder import get_model_3d_descriptor, merge_state  # noqa: E402
from deepshard.checkpoint.deepspeed_format.names import (  # noqa: E402
    get_layer_ckpt_name_for_rank,
    get_model_ckpt_name_for_rank,
    get_zero_ckpt_name_for_rank,
)
from deepshard.checkpoint.deepspeed_format.rank_maps import model_3d_desc, reshape_meg_2d_parallel  # noqa: E402
from deepshard.checkpoint.deepspeed_format.zero_files import ZeROCheckpoint  # noqa: E402

__all__ = [
    "LATEST_NAME", "MANIFEST_NAME", "CheckpointError", "DeepSpeedCheckpoint", "ZeROCheckpoint", "commit_staging",
    "file_digest", "flatten_state", "get_layer_ckpt_name_for_rank", "get_model_3d_descriptor",
    "get_model_ckpt_name_for_rank", "get_zero_ckpt_name_for_rank", "load_json", "load_tensors", "merge_state",
    "model_3d_desc", "read_latest", "recover_tag", "reshape_meg_2d_parallel", "save_json", "save_tensors",
    "staging_dir", "unflatten_state", "validate_tag", "verify_manifest", "write_latest", "write_manifest",
]


def __getattr__(name: str) -> Any:
    """DeepSpeed names this module does not provide: an AttributeError that says why and what to use."""
    from deepshard.compat.aliases import missing_attribute

    raise missing_attribute(__name__, name)
