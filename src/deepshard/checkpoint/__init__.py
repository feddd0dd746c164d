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

__all__ = [
    "LATEST_NAME", "MANIFEST_NAME", "CheckpointError", "commit_staging", "file_digest",
    "flatten_state", "load_json", "load_tensors", "read_latest", "recover_tag", "save_json",
    "save_tensors", "staging_dir", "unflatten_state", "validate_tag", "verify_manifest",
    "write_latest", "write_manifest",
]


def __getattr__(name: str) -> Any:
    """DeepSpeed names this module does not provide: an AttributeError that says why and what to use."""
    from deepshard.compat.aliases import missing_attribute

    raise missing_attribute(__name__, name)
