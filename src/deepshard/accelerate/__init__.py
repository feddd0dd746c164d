"""The one-import form of DeepSpeed through Hugging Face Accelerate, on deepshard:

    from deepshard.accelerate import Accelerator, DeepSpeedPlugin

is ``from accelerate import Accelerator, DeepSpeedPlugin`` with :func:`deepshard.compat.install` done
first, so the real Accelerate drives deepshard as its DeepSpeed (on CPU too). Nothing of Accelerate is
re-implemented: the names below are Accelerate's own objects. Take them from here before ``transformers``
is imported (it looks for DeepSpeed when it is first imported).

The package also holds Accelerate's launch front end, ``deepshard launch`` and ``deepshard config``
(:mod:`deepshard.accelerate.cli`, :mod:`deepshard.accelerate.launch_config`). Those run in the launcher's
process, which must neither need Accelerate nor answer ``import deepspeed`` itself: so Accelerate is
imported, and the compat finder installed, when one of the names below is first taken (PEP 562), not when a
module of the front end is loaded.
"""
from __future__ import annotations

from typing import Any

__all__ = ["Accelerator", "DeepSpeedPlugin", "DummyOptim", "DummyScheduler", "PartialState", "set_seed"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from deepshard.compat import install

    install()
    from accelerate import Accelerator, DeepSpeedPlugin, PartialState
    from accelerate.utils import DummyOptim, DummyScheduler, set_seed

    globals().update(Accelerator=Accelerator, DeepSpeedPlugin=DeepSpeedPlugin, PartialState=PartialState,
                     DummyOptim=DummyOptim, DummyScheduler=DummyScheduler, set_seed=set_seed)
    return globals()[name]
