"""Read one DeepSpeed ``.pt`` file without running any code from it.

``torch.load(weights_only=True)`` with ``ALLOWED``'s stand-ins as the only extra globals: a file naming
any other class or function (``os.system``, ``builtins.eval``, a model class) is refused before anything
in it is called, with a :class:`CheckpointError` naming the file and the class.
"""
from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from deepshard.checkpoint.deepspeed_format.allowlist import ALLOWED
from deepshard.checkpoint.io import CheckpointError
from deepshard.checkpoint.ledger import note_read


class UnsafeCheckpointError(CheckpointError):
    """A DeepSpeed file names a class or function outside the allowlist; nothing in it was run."""


def load_pt(path: Path) -> Any:
    """The object in ``path``, tensors on the CPU; only ``ALLOWED`` classes besides plain data."""
    if not path.is_file():
        raise CheckpointError(f"DeepSpeed checkpoint file {path} does not exist: the checkpoint is incomplete "
                              "(a rank's file was not written or not copied); copy the whole tag directory")
    note_read(path, path.stat().st_size)  # torch.load reads every record of the file
    with torch.serialization.safe_globals([(cls, name) for name, cls in ALLOWED.items()]):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise _refused(path, err) from None
        except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as err:
            raise CheckpointError(f"DeepSpeed checkpoint file {path} cannot be read ({_first_line(err)}): it is "
                                  "truncated or corrupted; copy it again from where it was written") from None


def _refused(path: Path, err: Exception) -> CheckpointError:
    try:
        names = [n for n in torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) if n not in ALLOWED]
    except Exception:  # noqa: BLE001 - the scan is only for the message; the refusal stands either way
        names = []
    what = ", ".join(names) if names else _first_line(err)
    return UnsafeCheckpointError(
        f"refused to load {path}: it names {what}, which is not one of the classes DeepSpeed writes into "
        f"checkpoints ({', '.join(sorted(ALLOWED))}); loading it would run code from the file. Nothing was "
        "executed. If you wrote this file yourself and trust it, convert it with torch.load(weights_only=False) "
        "in a separate process")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
