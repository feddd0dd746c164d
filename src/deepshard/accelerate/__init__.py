"""The one-import form of DeepSpeed through Hugging Face Accelerate, on deepshard:

    from deepshard.accelerate import Accelerator, DeepSpeedPlugin

is ``from accelerate import Accelerator, DeepSpeedPlugin`` with :func:`deepshard.compat.install` done
first, so the real Accelerate drives deepshard as its DeepSpeed (on CPU too). Nothing of Accelerate is
re-implemented: the names below are Accelerate's own objects. Import this before ``transformers`` (which
looks for DeepSpeed when it is first imported). ``deepshard launch --config_file`` starts scripts
written either way (:mod:`deepshard.launcher.accelerate_cli`).
"""
from __future__ import annotations

from deepshard.compat import install as _install

_install()

from accelerate import Accelerator, DeepSpeedPlugin, PartialState  # noqa: E402
from accelerate.utils import DummyOptim, DummyScheduler, set_seed  # noqa: E402

__all__ = ["Accelerator", "DeepSpeedPlugin", "DummyOptim", "DummyScheduler", "PartialState", "set_seed"]
