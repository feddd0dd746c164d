"""The files of one DeepSpeed-layout checkpoint tag folder, in the order their rank numbers give
(``deepspeed.utils.zero_to_fp32.get_optim_files`` and friends): ``rank_2`` before ``rank_10``."""
from __future__ import annotations

import glob
import os
import re
from pathlib import Path

__all__ = ["get_checkpoint_files", "get_model_state_files", "get_optim_files", "natural_keys"]


def natural_keys(text: str) -> list[int | str]:
    """A sort key that compares the digit runs of ``text`` as numbers (``"a2" < "a10"``)."""
    return [int(piece) if piece.isdigit() else piece for piece in re.split(r"(\d+)", text)]


def get_checkpoint_files(checkpoint_dir: str | Path, glob_pattern: str) -> list[str]:
    """The paths in ``checkpoint_dir`` matching ``glob_pattern``, in natural order; FileNotFoundError
    when there are none."""
    files = sorted(glob.glob(os.path.join(str(checkpoint_dir), glob_pattern)), key=natural_keys)
    if not files:
        raise FileNotFoundError(f"no {glob_pattern} files in directory '{checkpoint_dir}'; give the tag folder "
                                "of a checkpoint (e.g. ckpt/global_step100)")
    return files


def get_optim_files(checkpoint_dir: str | Path) -> list[str]:
    """Every rank's ``*_optim_states.pt`` of a tag folder, in rank order."""
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir: str | Path) -> list[str]:
    """Every ``*_model_states.pt`` of a tag folder, in rank order."""
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")
