"""``DeepSpeedConfigModel``: the pydantic base class DeepSpeed's config sections and its users' own config
classes derive from (``deepspeed.runtime.config_utils.DeepSpeedConfigModel``).

What it adds to ``pydantic.BaseModel``, as DeepSpeed's does:

* unknown keys are refused, values are validated on assignment too, enum fields hold their values;
* ``"auto"`` values (the placeholders Hugging Face writes) are dropped before validation unless the model
  is built with ``strict=True``, so the field keeps its default;
* deprecated fields, declared with ``Field(..., json_schema_extra={"deprecated": True, "new_param":
  "name", "new_param_fn": fn, "set_new_param": True, "deprecated_msg": "..."})``: giving one logs a
  warning and, when it names a ``new_param`` (dotted for a nested section), moves its value (through
  ``new_param_fn``) there; giving both the old and the new field raises :class:`DeprecatedFieldConflict`.

deepshard's own config sections (:mod:`deepshard.config`) are stricter models of their own; this class is
for code written against DeepSpeed's.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, field_serializer

from deepshard.utils.logging import logger

__all__ = ["DeepSpeedConfigModel", "DeprecatedFieldConflict", "get_config_default"]


class DeprecatedFieldConflict(ValueError, AssertionError):
    """A deprecated config field and the field replacing it were both given. (An AssertionError too: that
    is what DeepSpeed raises here, and what code written for it catches.)"""


class DeepSpeedConfigModel(BaseModel):
    """Base class of DeepSpeed-style config models (see the module docstring)."""

    model_config = ConfigDict(validate_default=True, validate_assignment=True, use_enum_values=True,
                              populate_by_name=True, extra="forbid", arbitrary_types_allowed=True,
                              protected_namespaces=())

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:
            data = {k: v for k, v in data.items() if not (isinstance(v, str) and v == "auto")
                    or k == "replace_method"}
        super().__init__(**data)
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated", False):
                self._apply_deprecated(name, extra)

    def _apply_deprecated(self, name: str, extra: dict[str, Any]) -> None:
        if name not in self.model_fields_set:
            return
        new_param = str(extra.get("new_param", ""))
        message = str(extra.get("deprecated_msg", ""))
        logger.warning("Config parameter %s is deprecated%s%s", name, f" use {new_param} instead" if new_param else "",
                       f". {message}" if message else "")
        if not new_param or not extra.get("set_new_param", True):
            return
        convert = extra.get("new_param_fn", lambda value: value)
        value = convert(getattr(self, name))
        self.model_fields_set.discard(name)
        *path, leaf = new_param.split(".")
        target = functools.reduce(getattr, path, self)
        if leaf in target.model_fields_set:
            raise DeprecatedFieldConflict(
                f"Cannot provide deprecated parameter '{name}' and replacing parameter '{new_param}' together; "
                f"keep only '{new_param}'")
        setattr(target, leaf, value)

    @field_serializer("dtype", check_fields=False)
    def _serialize_torch_dtype(self, dtype: torch.dtype) -> str:
        return str(dtype)


def get_config_default(config: Any, field_name: str) -> Any:
    """The default of ``config``'s field ``field_name`` (a model class or instance)."""
    fields = type(config).model_fields if isinstance(config, BaseModel) else config.model_fields
    if field_name not in fields:
        raise KeyError(f"'{field_name}' is not a field of {getattr(config, '__name__', type(config).__name__)}")
    info = fields[field_name]
    if info.is_required():
        raise ValueError(f"'{field_name}' is a required field and has no default value")
    return info.get_default(call_default_factory=True)
