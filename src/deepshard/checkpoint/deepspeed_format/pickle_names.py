"""``torch.save`` that writes deepshard's stand-ins under DeepSpeed's class names.

Python's pickler records a class by its own module and name and checks that importing them gives the
same object, so a stand-in cannot simply claim DeepSpeed's name. This pickler writes the ``GLOBAL``
opcode for each stand-in class itself (``deepspeed_name``); everything else pickles as usual. DeepSpeed
then unpickles the objects as its own ``LossScaler``, ``ZeroStageEnum`` and ``fragment_address``.
"""
from __future__ import annotations

import pickle
import types
from pathlib import Path
from typing import Any

import torch

from deepshard.checkpoint.deepspeed_format.allowlist import ALLOWED

_BY_CLASS = {cls: name for name, cls in ALLOWED.items()}


class _NamingPickler(pickle._Pickler):  # type: ignore[name-defined]  # the Python pickler: save_global is hookable
    def save_global(self, obj: Any, name: str | None = None) -> None:
        full = _BY_CLASS.get(obj)
        if full is None:
            super().save_global(obj, name)
            return
        module, _, qualname = full.rpartition(".")
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode("utf-8"))
        self.memoize(obj)


_MODULE = types.SimpleNamespace(Pickler=_NamingPickler, Unpickler=pickle.Unpickler, __name__="pickle")


def save_pt(obj: Any, path: Path) -> None:
    """Write ``obj`` atomically (a temporary file renamed into place)."""
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp, pickle_module=_MODULE)
    tmp.replace(path)
