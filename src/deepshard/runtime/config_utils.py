"""``deepspeed.runtime.config_utils`` under deepshard: the helpers DeepSpeed users call to read config
dictionaries and print them, and DeepSpeed's pydantic base class ``DeepSpeedConfigModel``
(:mod:`deepshard.runtime.config_model`)."""
from __future__ import annotations

import collections
import json
from typing import Any

from deepshard.runtime.config_model import DeepSpeedConfigModel, get_config_default

__all__ = ["DeepSpeedConfigModel", "DeepSpeedConfigObject", "ScientificNotationEncoder",
           "dict_raise_error_on_duplicate_keys", "get_config_default", "get_dict_param", "get_list_param",
           "get_scalar_param", "pp_int"]


def get_scalar_param(param_dict: dict[str, Any], param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default when the key is absent."""
    return param_dict.get(param_name, param_default_value)


def get_list_param(param_dict: dict[str, Any], param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default when the key is absent."""
    return param_dict.get(param_name, param_default_value)


def get_dict_param(param_dict: dict[str, Any], param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default when the key is absent."""
    return param_dict.get(param_name, param_default_value)


def dict_raise_error_on_duplicate_keys(ordered_pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A ``json.load(object_pairs_hook=...)`` hook: the pairs as a dict, or a ValueError naming every key
    that appears more than once."""
    counts = collections.Counter(key for key, _ in ordered_pairs)
    repeated = sorted(key for key, n in counts.items() if n > 1)
    if repeated:
        raise ValueError(f"Duplicate keys in DeepSpeed config: {repeated}")
    return dict(ordered_pairs)


class pp_int(int):  # noqa: N801 - DeepSpeed's name
    """An int that prints with thousands separators (``10,000``), or as ``custom_print_str``."""

    custom_print_str: str | None

    def __new__(cls, val: Any, custom_print_str: str | None = None) -> "pp_int":
        inst = super().__new__(cls, val)
        inst.custom_print_str = custom_print_str
        return inst

    def __repr__(self) -> str:
        return self.custom_print_str or f"{int(self):,}"


class ScientificNotationEncoder(json.JSONEncoder):
    """``json.dumps(..., cls=ScientificNotationEncoder)``: numbers above 1e3 written as ``1.000000e+04``,
    everything else as usual, nested dicts indented."""

    def iterencode(self, o: Any, _one_shot: bool = False, level: int = 0) -> Any:  # type: ignore[override]
        width = self.indent if isinstance(self.indent, int) else 4
        if isinstance(o, bool):
            return "true" if o else "false"
        if isinstance(o, (int, float)):
            return f"{o:e}" if o > 1e3 else f"{o}"
        if isinstance(o, collections.abc.Mapping):
            inner, outer = " " * (level + 1) * width, " " * level * width
            items = [f'\n{inner}"{k}": {self.iterencode(v, level=level + 1)}' for k, v in o.items()]
            return "{" + ", ".join(items) + f"\n{outer}" + "}"
        if isinstance(o, collections.abc.Sequence) and not isinstance(o, str):
            return "[" + ", ".join(self.iterencode(v, level=level) for v in o) + "]"
        return "\n, ".join(super().iterencode(o, _one_shot))


class DeepSpeedConfigObject:
    """A base class whose ``repr`` is its attributes as sorted, indented JSON."""

    def repr(self) -> dict[str, Any]:
        return self.__dict__

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4, cls=ScientificNotationEncoder)
