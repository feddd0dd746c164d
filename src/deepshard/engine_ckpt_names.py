"""The engine's names for two checkpoint files, under DeepSpeed's engine method names (code written for
DeepSpeed calls them, its own unit tests among it): the file holding a rank's optimizer state, and the
``zero_to_fp32.py`` recovery script put beside the checkpoints. deepshard's save and load use them too, so
what they say is what is written and read (``deepshard/checkpoint/engine_checkpoint.py``, ``engine_load.py``).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from deepshard.checkpoint.fragments import rank_files
from deepshard.utils.logging import logger


class EngineCheckpointNames:
    """Mixed into the engine; reads ``self.topology`` (the global rank names a process's files)."""

    topology: Any

    def _get_optimizer_ckpt_name(self, checkpoints_path: str | os.PathLike[str], tag: Any,
                                 expp_rank: int = 0) -> str:
        """The path of this process's optimizer-state file in checkpoint ``checkpoints_path/tag``.

        deepshard keeps a rank's optimizer state with its fp32 weight fragments, in
        ``<tag>/zero_rank<global rank>.safetensors`` (docs/checkpoints.md): ``save_checkpoint`` writes
        the file this returns, and a load that restores optimizer state at ZeRO 1-3 asks for it and reads it
        first (stage 0 reads every rank file whole); a module-only load (``load_optimizer_states=False`` or
        ``load_module_only=True``) never asks.
        ``expp_rank`` (DeepSpeed's expert-parallel rank, which picks among its per-expert-group files) is
        accepted for DeepSpeed's signature: the global rank already fixes a process's expert-parallel rank."""
        del expp_rank  # one file per global rank holds every group's state of this process
        return os.path.join(str(checkpoints_path), str(tag), rank_files(self.topology.rank)[0])

    def _change_recovery_script_permissions(self, dst: str | os.PathLike[str]) -> None:
        """Make the recovery script ``dst`` (the ``zero_to_fp32.py`` that ``save_checkpoint`` writes
        beside the tags) executable. Where that is not allowed (file shares such as Azure Files) or the file
        is gone, the failure is logged at info level and the save goes on: the script still runs as
        ``python zero_to_fp32.py``."""
        try:
            os.chmod(dst, os.stat(dst).st_mode | stat.S_IEXEC)
        except (FileNotFoundError, PermissionError) as err:
            logger.info("could not make %s executable (%s); continuing without changing its permissions: "
                        "run it as 'python %s'", dst, err, Path(dst).name)
