"""Split nested Python state into tensors (for safetensors) and a JSON skeleton (for metadata).

This is how optimizer state dicts (int keys, tuple ``betas``, 0-d ``step`` tensors), LR scheduler
state, loss-scaler state, RNG states and the user's ``client_state`` are stored without pickle.

Skeleton encoding (plain JSON; markers are one-key objects):

=========================  =================================================================
value                      JSON
=========================  =================================================================
None, bool, int, str       themselves
finite float               itself (``repr`` round-trips exactly)
inf, -inf, nan             ``{"__float__": "inf" | "-inf" | "nan"}``
torch.Tensor               ``{"__tensor__": key}`` (the key into the tensors dict)
tuple                      ``{"__tuple__": [items]}``
list                       ``[items]``
dict, all keys str         ``{key: value}`` (unless a key is a marker name)
any other dict             ``{"__dict__": [[key, value], ...]}`` (int/tuple/... keys, order kept)
torch.dtype                ``{"__dtype__": "float32"}``
torch.Size                 ``{"__size__": [dims]}``
torch.device               ``{"__device__": "cuda:0"}``
=========================  =================================================================

Subclasses of int/float/str/dict/list (e.g. ``OrderedDict``, ``IntEnum``) come back as the base type.
The same tensor object reached twice is stored once and comes back as one object. The key order of
str-keyed dicts is kept in memory but not on disk, because :func:`save_json` sorts keys.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from deepshard.checkpoint.io import CheckpointError

__all__ = ["flatten_state", "unflatten_state"]

_TENSOR, _TUPLE, _FLOAT, _DICT = "__tensor__", "__tuple__", "__float__", "__dict__"
_DTYPE, _SIZE, _DEVICE = "__dtype__", "__size__", "__device__"
_MARKERS = frozenset({_TENSOR, _TUPLE, _FLOAT, _DICT, _DTYPE, _SIZE, _DEVICE})
_SPECIAL_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


class _Flattener:
    """One pass over a structure; collects tensors and detects cycles."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.tensor_keys: dict[int, str] = {}
        self.active: set[int] = set()

    def encode(self, obj: Any, path: str, allow_tensors: bool = True) -> Any:
        if obj is None or isinstance(obj, bool):
            return obj
        if isinstance(obj, str):
            return str(obj)
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return _encode_float(float(obj))
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path, allow_tensors)
        if isinstance(obj, torch.dtype):
            return {_DTYPE: str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.Size):
            return {_SIZE: [int(d) for d in obj]}
        if isinstance(obj, torch.device):
            return {_DEVICE: str(obj)}
        if type(obj) is tuple or isinstance(obj, (list, dict)):
            return self._container(obj, path, allow_tensors)
        raise TypeError(_unstorable(obj, path))

    def _tensor(self, tensor: torch.Tensor, path: str, allow: bool) -> dict[str, str]:
        if not allow:
            raise TypeError(f"{path} is a tensor used as a dict key; dict keys must be str, int, "
                            "float, bool, None or tuples of those")
        key = self.tensor_keys.get(id(tensor))
        if key is None:
            key = path
            self.tensor_keys[id(tensor)] = key
            self.tensors[key] = tensor
        return {_TENSOR: key}

    def _container(self, obj: Any, path: str, allow: bool) -> Any:
        if id(obj) in self.active:
            raise ValueError(f"{path} contains itself (a reference cycle); checkpoint state must be "
                             "a tree: break the cycle before saving")
        self.active.add(id(obj))
        try:
            if isinstance(obj, dict):
                return self._dict(obj, path, allow)
            items = [self.encode(v, f"{path}[{i}]", allow) for i, v in enumerate(obj)]
            return {_TUPLE: items} if isinstance(obj, tuple) else items
        finally:
            self.active.discard(id(obj))

    def _dict(self, obj: dict, path: str, allow: bool) -> Any:
        if all(type(k) is str and k not in _MARKERS for k in obj):
            return {k: self.encode(v, f"{path}[{k!r}]", allow) for k, v in obj.items()}
        pairs = []
        for k, v in obj.items():
            key = self.encode(k, f"{path} key {k!r}", allow_tensors=False)
            pairs.append([key, self.encode(v, f"{path}[{k!r}]", allow)])
        return {_DICT: pairs}


def _encode_float(value: float) -> Any:
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return {_FLOAT: "nan"}
    return {_FLOAT: "inf" if value > 0 else "-inf"}


def _unstorable(obj: Any, path: str) -> str:
    kind = type(obj).__name__
    hint = "store its state as tensors/numbers/strings"
    if hasattr(obj, "state_dict"):
        hint = "store obj.state_dict() instead and rebuild it with load_state_dict() on resume"
    elif isinstance(obj, tuple):
        hint = "convert the named tuple with tuple(x) or x._asdict()"
    return f"{path} is a {kind}, which cannot be stored without pickle; {hint}"


def flatten_state(obj: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], Any]:
    """Split ``obj`` into ``(tensors, skeleton)``; :func:`unflatten_state` is the exact inverse.

    ``tensors`` maps a unique path string (``prefix`` followed by Python-style subscripts, e.g.
    ``optimizer['state'][0]['exp_avg']``; ``state`` when ``prefix`` is empty) to each tensor; ``skeleton`` is JSON-serializable with each
    tensor replaced by ``{"__tensor__": key}``. Use distinct prefixes for structures whose tensors
    share one safetensors file. Raises ``TypeError`` naming the path of any value that cannot be
    stored without pickle (functions, arbitrary objects, named tuples, sets, numpy arrays).
    """
    flattener = _Flattener()
    skeleton = flattener.encode(obj, prefix or "state")
    return flattener.tensors, skeleton


def unflatten_state(tensors: dict[str, torch.Tensor], skeleton: Any) -> Any:
    """Rebuild the structure that :func:`flatten_state` split into ``tensors`` and ``skeleton``.

    Raises :class:`CheckpointError` if the skeleton names a tensor that ``tensors`` lacks or is not
    a skeleton at all (the JSON and safetensors files of a checkpoint do not match).
    """
    if skeleton is None or isinstance(skeleton, (bool, int, float, str)):
        return skeleton
    if isinstance(skeleton, list):
        return [unflatten_state(tensors, v) for v in skeleton]
    if not isinstance(skeleton, dict):
        raise CheckpointError(f"checkpoint skeleton holds a {type(skeleton).__name__} ({skeleton!r}), "
                              "which flatten_state never writes; the metadata file is corrupted")
    if len(skeleton) == 1:
        (marker, payload), = skeleton.items()
        if marker in _MARKERS:
            return _decode_marker(tensors, marker, payload)
    return {k: unflatten_state(tensors, v) for k, v in skeleton.items()}


def _decode_marker(tensors: dict[str, torch.Tensor], marker: str, payload: Any) -> Any:
    try:
        if marker == _TENSOR:
            return _lookup(tensors, payload)
        if marker == _TUPLE:
            return tuple(unflatten_state(tensors, v) for v in payload)
        if marker == _FLOAT:
            return _SPECIAL_FLOATS[payload]
        if marker == _DICT:
            return {_hashable(unflatten_state(tensors, k)): unflatten_state(tensors, v)
                    for k, v in payload}
        if marker == _DTYPE:
            dtype = getattr(torch, payload)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"torch.{payload} is not a dtype")
            return dtype
        if marker == _SIZE:
            return torch.Size(int(d) for d in payload)
        return torch.device(payload)
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint skeleton has a malformed {marker} entry {payload!r} "
                              f"({err}); the metadata file is corrupted") from err


def _lookup(tensors: dict[str, torch.Tensor], key: Any) -> torch.Tensor:
    if not isinstance(key, str) or key not in tensors:
        sample = ", ".join(sorted(tensors)[:5])
        raise CheckpointError(f"checkpoint metadata references tensor {key!r}, which is not among the "
                              f"{len(tensors)} loaded tensors (e.g. {sample or 'none'}); its JSON and "
                              "safetensors files come from different saves or one is damaged")
    return tensors[key]


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, dict, torch.Tensor)):
        raise TypeError(f"dict key {key!r} is not hashable")
    return key
