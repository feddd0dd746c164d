"""Shared pieces of the config package: the error type, the strict section base model, dtype names.

Every config section is a :class:`Section`: a pydantic model that

* forbids unknown keys (the loader turns pydantic's complaint into a message that names the full
  path of the key and the closest valid key),
* is strict about types (a string where a number is expected is an error, except that a nested section
  converts a number written as a string, ``"3"``, as DeepSpeed's pydantic sections do; an ``int`` is
  accepted for a ``float`` field; integral floats such as ``5e8`` are accepted for :data:`Count` fields),
* drops scalar ``"auto"`` values before validation so the field takes its default, which is what
  DeepSpeed's ``DeepSpeedConfigModel`` does with the placeholders Hugging Face writes,
* refuses a key given under two spellings at once (a field name and its alias).
"""
from __future__ import annotations

import math
import types
import typing
from typing import Annotated, Any, ClassVar

import torch
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

from deepshard.utils.logging import logger

AUTO = "auto"

HF_AUTO_HINT = (
    "'auto' is filled in by the Hugging Face Trainer/Accelerate from their own arguments; "
    "deepshard.initialize has nothing to fill it from; give a number"
)

# Error type used for messages that are complete sentences already (they name the key path).
EXACT_ERROR_TYPE = "deepshard_config"


class ConfigError(ValueError):
    """A config that cannot be used. The message names the key, what is wrong and how to fix it."""


def exact_error(message: str) -> PydanticCustomError:
    """A pydantic error whose message is reported to the user verbatim (no path prefix added)."""
    return PydanticCustomError(EXACT_ERROR_TYPE, "{message}", {"message": message})


def key_path(section_path: str, key: str) -> str:
    """``zero_optimization`` + ``stage`` -> ``zero_optimization.stage``; top level -> ``stage``."""
    return f"{section_path}.{key}" if section_path else key


# ----------------------------------------------------------------------------------------- dtypes

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def dtype_from_name(name: str) -> torch.dtype:
    """Map a config dtype name to a ``torch.dtype``.

    Accepts ``fp32``/``float32``/``float``, ``fp16``/``float16``/``half`` and ``bf16``/``bfloat16``,
    case-insensitively and with an optional ``torch.`` prefix (``"torch.bfloat16"``). Anything else
    raises :class:`ConfigError` listing the valid names.
    """
    if isinstance(name, torch.dtype) and name in _DTYPE_NAMES.values():
        return name
    if not isinstance(name, str):
        raise ConfigError(
            f"a dtype name must be a string such as 'bf16', got {name!r} ({type(name).__name__})")
    key = name.strip().lower()
    key = key[len("torch."):] if key.startswith("torch.") else key
    if key not in _DTYPE_NAMES:
        raise ConfigError(
            f"unknown dtype name {name!r}; valid names: {', '.join(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[key]


def _check_dtype_name(value: str) -> str:
    dtype_from_name(value)
    return value


DtypeName = Annotated[str, AfterValidator(_check_dtype_name)]
"""A string field that must be a name :func:`dtype_from_name` understands (kept as written)."""


# ------------------------------------------------------------------------------ integral counts

def _integral(value: Any) -> Any:
    """Let ``5e8`` (a float in JSON) stand for the integer 500000000; reject ``1.5``."""
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        raise ValueError(f"expected a whole number, got {value!r}")
    return value


Count = Annotated[int, BeforeValidator(_integral)]
"""An integer field (bucket sizes, thresholds, buffer counts) that also accepts integral floats."""


def _zero_or_one(value: Any) -> Any:
    """Let the integers 1 and 0 stand for true and false (any other value is left to the strict check)."""
    if type(value) is int and value in (0, 1):
        return bool(value)
    return value


ScalarFlag = Annotated[bool, BeforeValidator(_zero_or_one)]
"""A top-level on/off key that DeepSpeed reads as a plain value and tests for truth, so clients write
``1`` / ``0`` for it (DeepSpeed's own tests write ``"zero_allow_untested_optimizer": 1``); other
non-booleans are still refused."""


# ------------------------------------------------------------------------------- section base

def drop_auto_values(data: dict[str, Any], section_path: str) -> dict[str, Any]:
    """A copy of ``data`` without the keys whose value is the string ``"auto"``."""
    kept: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, str) and value == AUTO:
            logger.debug("config key '%s' is 'auto'; ignored (its default, or a derived value, is used)",
                         key_path(section_path, key))
            continue
        kept[key] = value
    return kept


def _number_kind(annotation: Any) -> type | None:
    """``int`` or ``float`` when a field takes a number and no string (``Optional`` and ``Annotated``
    looked through); None otherwise."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _number_kind(args[0])
    if origin in (typing.Union, types.UnionType):
        kinds = [_number_kind(arg) for arg in args if arg is not type(None)]
        if not kinds or None in kinds:
            return None  # a string (or something else) is a valid value too: leave it to the field
        return float if float in kinds else int
    return annotation if annotation in (int, float) else None


def convert_number_strings(model: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with a number written as a string (``"loss_scale": "3"``) converted where the field takes a
    number, as DeepSpeed's pydantic config sections convert it (a DeepSpeed config runs unchanged); a
    string that is not a number is left for the field's check to refuse."""
    for name, field in model.model_fields.items():
        for key in {name, field.alias or name}:
            value = data.get(key)
            kind = _number_kind(field.annotation) if isinstance(value, str) else None
            if kind is not None:
                try:
                    data[key] = kind(value.strip())
                except ValueError:
                    pass
    return data


def reject_alias_duplicates(model: type[BaseModel], data: dict[str, Any], section_path: str) -> None:
    """Raise if one setting is given under both its name and its alias."""
    for name, field in model.model_fields.items():
        alias = field.alias
        if alias and alias != name and name in data and alias in data:
            raise exact_error(
                f"config keys '{key_path(section_path, alias)}' and '{key_path(section_path, name)}' "
                "are two spellings of the same setting; give only one")


class Section(BaseModel):
    """Base of every config section: strict types, unknown keys forbidden, ``"auto"`` dropped."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    section_path: ClassVar[str] = ""
    """Where this section sits in the config (``"zero_optimization.offload_param"``); for messages."""

    @model_validator(mode="before")
    @classmethod
    def _prepare_input(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # pydantic reports the wrong type with the path
        data = drop_auto_values(data, cls.section_path)
        reject_alias_duplicates(cls, data, cls.section_path)
        if cls.section_path:  # DeepSpeed reads its top-level keys as given (a string there fails in it too)
            data = convert_number_strings(cls, data)
        return cls.prepare(data)

    @classmethod
    def prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Hook for sections that rewrite their input (deprecated keys); ``data`` is a fresh copy."""
        return data
