"""ZeRO-3 leaf modules (``deepspeed.utils.z3_leaf_module``): modules whose whole subtree ZeRO-3 gathers at once
around their forward instead of hooking each child, for modules that read their children's parameters
directly or mixture-of-experts blocks that call only some experts (whose order would otherwise change
between steps).

A module is marked by class (a class object, its name, or its fully qualified ``module.QualName``), by its
name in ``model.named_modules()``, or by a suffix of that name; the config's
``zero_optimization.leaf_module`` section does the same at ``initialize`` (:func:`apply_zero_leaf_module_config`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from deepshard.utils.logging import logger

if TYPE_CHECKING:
    import torch

__all__ = ["apply_zero_leaf_module_config", "get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules",
           "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules",
           "z3_leaf_module", "z3_leaf_parameter"]


def z3_leaf_module(model: "torch.nn.Module") -> bool:
    """Whether ``model`` is marked as a ZeRO-3 leaf."""
    return bool(getattr(model, "_z3_leaf", False))


def z3_leaf_parameter(param: "torch.nn.Parameter") -> bool:
    """Whether ``param`` belongs to a leaf module (ZeRO-3 marks such parameters)."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: "torch.nn.Module") -> list["torch.nn.Module"]:
    """Every module of ``model`` marked as a leaf, in ``modules()`` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: "torch.nn.Module", flag: bool) -> None:
    """Mark (or unmark) one module."""
    model._z3_leaf = flag


def _matches(module: "torch.nn.Module", wanted: Any) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _set_by_class(model: "torch.nn.Module", classes: Sequence[Any], flag: bool,
                  raise_if_not_found: bool) -> list["torch.nn.Module"]:
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf module classes must be classes or class names, got {bad}")
    marked = []
    for module in model.modules():
        if any(_matches(module, c) for c in classes):
            module._z3_leaf = flag
            marked.append(module)
    if not marked and raise_if_not_found:
        raise ValueError(f"no submodule of {type(model).__name__} is an instance of {list(classes)}; check the "
                         "class names (plain or fully qualified) or pass raise_if_not_found=False")
    return marked


def set_z3_leaf_modules(model: "torch.nn.Module", leaf_module_classes: Sequence[Any],
                        raise_if_not_found: bool = True) -> list["torch.nn.Module"]:
    """Mark every submodule whose class is one of ``leaf_module_classes`` (classes, class names or fully
    qualified names); returns them. Call it before ``initialize``."""
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: "torch.nn.Module", leaf_module_classes: Sequence[Any],
                          raise_if_not_found: bool = True) -> list["torch.nn.Module"]:
    """Undo :func:`set_z3_leaf_modules` for those classes; returns the modules unmarked."""
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: "torch.nn.Module", module_names: Sequence[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list["torch.nn.Module"], list[str]]:
    """Mark the modules named (as ``model.named_modules()`` names them); returns (modules, names not found)."""
    by_name = dict(model.named_modules())
    matched, missing = [], []
    for name in module_names:
        module = by_name.get(name)
        if module is None:
            missing.append(name)
            continue
        module._z3_leaf = flag
        matched.append(module)
    if missing and raise_if_not_found:
        raise ValueError(f"no modules named {missing} in {type(model).__name__} (names as named_modules() gives "
                         "them, e.g. 'model.layers.0.mlp'); pass raise_if_not_found=False to skip them")
    return matched, missing


def set_z3_leaf_modules_by_suffix(model: "torch.nn.Module", module_name_suffixes: Sequence[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list["torch.nn.Module"], list[str]]:
    """Mark every module whose name ends with one of the suffixes; returns (modules, suffixes matching none)."""
    named = list(model.named_modules())
    matched: list["torch.nn.Module"] = []
    missing = []
    for suffix in module_name_suffixes:
        hits = [module for name, module in named if name.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for module in hits:
            module._z3_leaf = flag
            if all(module is not m for m in matched):
                matched.append(module)
    if missing and raise_if_not_found:
        raise ValueError(f"no module names end with {missing} in {type(model).__name__}; pass "
                         "raise_if_not_found=False to skip them")
    return matched, missing


def apply_zero_leaf_module_config(model: "torch.nn.Module", leaf_cfg: Any) -> list["torch.nn.Module"]:
    """Mark the leaves a ``zero_optimization.leaf_module`` section names (classes, names, name suffixes); the
    names and suffixes the config gives that match nothing are warned about (the default classes, which
    name Hugging Face mixture-of-experts blocks, simply do not match other models)."""
    if leaf_cfg is None:
        return []
    from deepshard.zero.leaf_module_config import DEFAULT_LEAF_MODULE_NAME_SUFFIXES, DEFAULT_LEAF_MODULE_NAMES

    marked: list["torch.nn.Module"] = []

    def add(modules: list["torch.nn.Module"]) -> None:
        marked.extend(m for m in modules if all(m is not seen for seen in marked))

    if leaf_cfg.classes:
        add(set_z3_leaf_modules(model, leaf_cfg.classes, raise_if_not_found=False))
    for found, missing, given, default, what in (
            (*set_z3_leaf_modules_by_name(model, leaf_cfg.names, raise_if_not_found=False), leaf_cfg.names,
             DEFAULT_LEAF_MODULE_NAMES, "module names"),
            (*set_z3_leaf_modules_by_suffix(model, leaf_cfg.name_suffixes, raise_if_not_found=False),
             leaf_cfg.name_suffixes, DEFAULT_LEAF_MODULE_NAME_SUFFIXES, "module name suffixes")):
        add(found)
        if missing and list(given) != list(default):
            logger.warning("zero_optimization.leaf_module lists %s that match no module: %s", what, missing)
    return marked
