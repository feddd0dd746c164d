"""The import machinery behind ``deepshard.compat``: a meta-path finder that answers ``import deepspeed``
(and ``deepspeed.*``) with deepshard's modules, and the ``deepspeed`` distribution metadata Accelerate and
transformers check before they import it.

Each ``deepspeed.*`` module is a small alias module (:class:`AliasModule`) whose attributes are looked up
on the deepshard module that implements it, so every name is deepshard's own object (``isinstance``
and identity hold) while deepshard's modules keep their own names, specs and attributes untouched.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys
import types
from pathlib import Path
from typing import Any, Iterable

from deepshard.compat.aliases import refusal, target_of

DEEPSPEED_CONTRACT = "0.19.8"
"""The DeepSpeed release whose public contract deepshard follows (what the shim reports as its version)."""


def shim_version() -> str:
    """``0.19.8+deepshard.<version>``: DeepSpeed's contract version, with deepshard's as the local label
    so version checks pass and the string still says what is installed."""
    from deepshard._version import __version__

    return f"{DEEPSPEED_CONTRACT}+deepshard.{__version__}"


_MACHINERY = frozenset({"__path__", "__spec__", "__loader__", "__package__", "__file__", "__cached__",
                        "__builtins__", "__getattr__", "__dir__", "__wrapped__"})
"""Module attributes the import system reads or sets on the alias itself; never the implementation's."""


class AliasModule(types.ModuleType):
    """``deepspeed.<x>``: attribute reads go to the deepshard module ``target``."""

    def __init__(self, name: str, target: types.ModuleType) -> None:
        super().__init__(name, getattr(target, "__doc__", None))
        self.__dict__["_deepshard_target"] = target
        if getattr(target, "__file__", None):
            self.__file__ = target.__file__  # error messages then point at deepshard's module
        if name == "deepspeed":
            self.__version__ = shim_version()
            major, minor, patch = (int(part) for part in DEEPSPEED_CONTRACT.split("."))
            self.__version_major__, self.__version_minor__, self.__version_patch__ = major, minor, patch

    def __getattr__(self, name: str) -> Any:
        target = self.__dict__["_deepshard_target"]
        if name in _MACHINERY:
            raise AttributeError(name)
        try:
            return getattr(target, name)
        except AttributeError:
            raise AttributeError(refusal(f"{self.__name__}.{name}"), name=name, obj=self) from None

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self.__dict__["_deepshard_target"])) | set(self.__dict__))


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: types.ModuleType) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return AliasModule(spec.name, self.target)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the implementation was imported when the spec was found."""


class _ShimDistribution(importlib.metadata.Distribution):
    """The ``deepspeed`` distribution as ``importlib.metadata`` reports it while the shim is installed."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {shim_version()}\n"
                    "Summary: deepshard standing in for DeepSpeed (deepshard.compat)\n")
        if filename == "top_level.txt":
            return "deepspeed\n"
        return None

    def locate_file(self, path: str | os.PathLike[str]) -> Path:
        return Path(__file__).resolve().parents[2] / path  # the folder deepshard is installed in


class DeepSpeedFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` while installed: ``deepspeed`` and ``deepspeed.*`` resolve to deepshard."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        impl_name = target_of(fullname)
        try:
            impl = importlib.import_module(impl_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (impl_name + ".").startswith(exc.name + "."):
                return None  # deepshard has no such module: "No module named 'deepspeed.x'"
            raise
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(impl), is_package=True)

    def find_distributions(self, context: Any = None) -> Iterable[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.replace("-", "_").lower() == "deepspeed":
            return iter([_ShimDistribution()])
        return iter([])


class DeepshardSpellingFinder(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path`` from ``import deepshard`` on: ``deepshard.X`` answers for every DeepSpeed
    module path ``deepspeed.X`` whose implementation lives under another deepshard name (the same table,
    :data:`deepshard.compat.aliases.RENAMED`), so a one-import user writes ``deepshard.runtime.zero.stage3``
    where DeepSpeed's docs say ``deepspeed.runtime.zero.stage3``. Real deepshard modules are found first
    (this finder only sees names the file system does not have); no ``deepspeed`` name is touched."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("deepshard."):
            return None
        impl_name = target_of("deepspeed" + fullname[len("deepshard"):], shown=fullname)
        if impl_name == fullname:
            return None  # not a renamed path: "No module named 'deepshard.x'"
        try:
            impl = importlib.import_module(impl_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (impl_name + ".").startswith(exc.name + "."):
                return None  # the implementation has no such submodule: "No module named 'deepshard.x.y'"
            raise
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(impl), is_package=True)


def install_spelling_finder() -> None:
    """Put :class:`DeepshardSpellingFinder` at the end of ``sys.meta_path`` once (``import deepshard`` does)."""
    if not any(isinstance(f, DeepshardSpellingFinder) for f in sys.meta_path):
        sys.meta_path.append(DeepshardSpellingFinder())
