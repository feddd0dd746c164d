"""The file names of DeepSpeed's checkpoint layout (what ``write.py`` writes and ``detect.py`` reads), by
rank: ``mp_rank_00_model_states.pt``, ``zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt`` /
``..._optim_states.pt``, ``layer_{i:02d}-model_states.pt``; DeepSpeed's ``deepspeed.checkpoint.utils`` names."""
from __future__ import annotations

import os

__all__ = ["get_layer_ckpt_name_for_rank", "get_model_ckpt_name_for_rank", "get_zero_ckpt_name_for_rank"]

MODEL_FILE_PREFIX = "mp_rank_"
ZERO_FILE_PREFIX = "zero_pp_rank_"
OPTIM_FILE_SUFFIX = "_optim_states.pt"
MODEL_FILE_SUFFIX = "_model_states.pt"
LAYER_FILE_PREFIX = "layer_"


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """The model-states file of model-parallel rank ``mp_rank_str`` (``"00"``) in a tag folder."""
    return os.path.join(base_folder, f"{MODEL_FILE_PREFIX}{mp_rank_str}{MODEL_FILE_SUFFIX}")


def get_zero_ckpt_name_for_rank(base_folder: str, dp_rank: int, mp_rank: int) -> str:
    """The ZeRO optimizer-states file of data-parallel rank ``dp_rank`` and model-parallel rank ``mp_rank``."""
    return os.path.join(base_folder, f"{ZERO_FILE_PREFIX}{dp_rank}_{MODEL_FILE_PREFIX}{mp_rank:02d}{OPTIM_FILE_SUFFIX}")


def get_layer_ckpt_name_for_rank(base_folder: str, layer_id: str, tp_rank: str) -> str:
    """A pipeline layer's file (``layer_id`` and ``tp_rank`` as DeepSpeed formats them, e.g. ``"01"``, ``"00"``)."""
    return os.path.join(base_folder, f"{LAYER_FILE_PREFIX}{layer_id}-{MODEL_FILE_PREFIX}{tp_rank}{MODEL_FILE_SUFFIX}")
