"""``engine.config`` as DeepSpeed exposes it: the config dict the engine was given.

DeepSpeed's ``engine.config`` is that dict (the Trainer reads ``engine.config.get("zero_optimization",
{})``); deepshard's validated config is a typed object. :class:`ConfigView` is both: a ``dict`` of the
config as given (a copy: writing to it changes nothing), whose attribute reads
(``engine.config.zero_optimization.stage``) go to the typed config.
"""
from __future__ import annotations

import copy
from typing import Any


class ConfigView(dict):
    """The config as given, as a dict; attributes read through to the validated config ``typed``."""

    def __init__(self, typed: Any) -> None:
        super().__init__(copy.deepcopy(typed.raw))
        self._typed = typed

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.__dict__["_typed"], name)
