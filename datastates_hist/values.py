"""Plain values (hyper-parameters, data positions, RNG states) as safe JSON.

No pickle: a value is made of None, bool, int, float, str, bytes, list, tuple
and dict, and numpy scalars. JSON has no tuples, bytes or non-string keys, so
those are tagged (``{"__tuple__": [...]}``, ``{"__bytes__": "<base64>"}``,
``{"__dict__": [[key, value], ...]}``). Decoding builds only those types, so
a store from elsewhere cannot run code.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any

import numpy as np

from .errors import CorruptionError

TAGS = ("__tuple__", "__bytes__", "__dict__", "__tensor__", "__ndarray__", "__float__")

# Lists, tuples and dicts inside each other: deeper than this is refused when written
# (encoding, decoding and JSON all recurse, and would fail later, in the background).
MAX_DEPTH = 100

# numpy kinds with no tensor dtype: strings, objects, dates, durations, structured records
NON_NUMERIC_KINDS = {"U": "strings", "S": "byte strings", "O": "Python objects", "M": "dates",
                     "m": "time durations", "V": "structured records"}


class UnsupportedValueError(TypeError):
    """A value has a type that cannot be stored without pickle."""


class NestingError(ValueError):
    """A value contains itself, or is nested deeper than :data:`MAX_DEPTH`."""


class NameClashError(ValueError):
    """Two entries of a value would be stored under one name (keys ``1`` and ``"1"``)."""


def enter(container: Any, where: str, around: tuple[int, ...]) -> tuple[int, ...]:
    """``around`` (the ids of the containers that hold ``container``) plus ``container``;
    refuses a container inside itself and nesting deeper than :data:`MAX_DEPTH`."""
    if id(container) in around:
        raise NestingError(f"{where} contains itself (a list, tuple or dict that holds itself)")
    if len(around) >= MAX_DEPTH:
        shown = where if len(where) <= 60 else where[:60] + "..."
        raise NestingError(f"{shown} is nested more than {MAX_DEPTH} levels deep "
                           "(lists, tuples and dicts inside each other)")
    return around + (id(container),)


def check_nesting(value: Any, where: str) -> None:
    """Refuse a structure of lists, tuples and dicts that contains itself or is nested
    deeper than :data:`MAX_DEPTH`; ``where`` names it, its path is appended. Iterative:
    no recursion to run out of."""
    todo = [(value, where, ())]
    while todo:
        x, path, around = todo.pop()
        if isinstance(x, dict):
            children = ((v, f"{path}/{k}") for k, v in x.items())
        elif isinstance(x, (list, tuple)):
            if all(type(v) is int for v in x):  # RNG states: hundreds of plain ints
                continue
            children = ((v, f"{path}/{i}") for i, v in enumerate(x))
        else:
            continue
        inner = enter(x, path, around)
        todo.extend((v, p, inner) for v, p in children if isinstance(v, (dict, list, tuple)))


def array_tensor(array: np.ndarray, where: str):
    """A numeric numpy array as a tensor, in native byte order (value-exact);
    arrays of strings, objects, dates or records are refused, naming ``where``."""
    import torch

    kind = NON_NUMERIC_KINDS.get(array.dtype.kind)
    if kind is not None:
        raise UnsupportedValueError(
            f"{where}: a numpy array of {kind} (dtype {array.dtype}) cannot be stored; "
            "only arrays of numbers and booleans can (convert it, e.g. to a list)"
        )
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    try:
        return torch.from_numpy(np.ascontiguousarray(array))
    except TypeError:  # a dtype torch has no equivalent of, such as float128
        raise UnsupportedValueError(
            f"{where}: a numpy array of dtype {array.dtype} cannot be stored (torch has no such dtype)"
        ) from None


def encode(value: Any, where: str) -> Any:
    """Turn ``value`` into JSON-ready data; ``where`` names it in errors."""
    return _encode(value, where, ())


def _encode(value: Any, where: str, around: tuple[int, ...]) -> Any:
    """:func:`encode`; ``around``: the ids of the containers that hold ``value``."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        # JSON has no NaN/Infinity: keep them exact through a tag.
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, (list, tuple)):
        # all plain ints (RNG states: hundreds of them each write): as they are, unwalked
        if all(type(v) is int for v in value):
            items = list(value)
        else:
            inner = enter(value, where, around)
            items = [_encode(v, f"{where}[{i}]", inner) for i, v in enumerate(value)]
        return items if isinstance(value, list) else {"__tuple__": items}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, dict):
        inner = enter(value, where, around)
        if all(isinstance(k, str) for k in value) and not any(k in TAGS for k in value):
            return {k: _encode(v, f"{where}.{k}", inner) for k, v in value.items()}
        return {"__dict__": [[_encode(k, where, inner), _encode(v, f"{where}[{k!r}]", inner)]
                             for k, v in value.items()]}
    raise UnsupportedValueError(
        f"{where}: a value of type {type(value).__module__}.{type(value).__qualname__} "
        "cannot be stored without pickle; convert it to numbers, strings, lists and dicts, "
        "give it state_dict()/load_state_dict(), or register a StateProvider for its type"
    )


def decode(data: Any, tensors: dict | None = None) -> Any:
    """Rebuild a value from :func:`encode`'s output.

    ``tensors`` maps the names of ``{"__tensor__": name}`` placeholders to the
    tensors that replace them. A stored value that :func:`encode` cannot have
    written (damaged or crafted) raises :class:`CorruptionError`.
    """
    try:
        return _decode(data, tensors)
    except (TypeError, ValueError, KeyError, binascii.Error, RecursionError) as exc:
        raise CorruptionError(f"a stored value is malformed ({type(exc).__name__}: {exc})") from None


def _decode(data: Any, tensors: dict | None) -> Any:
    if isinstance(data, list):
        return [_decode(v, tensors) for v in data]
    if isinstance(data, dict):
        if len(data) == 1:
            (tag, inner), = data.items()
            if tag == "__tuple__":
                return tuple(_decode(v, tensors) for v in inner)
            if tag == "__bytes__":
                return base64.b64decode(inner)
            if tag == "__float__":
                return float(inner)
            if tag == "__dict__":
                return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in inner}
            if tag in ("__tensor__", "__ndarray__"):
                if tensors is None or inner not in tensors:
                    raise KeyError(f"the value refers to tensor {inner!r}, which was not loaded")
                return tensors[inner] if tag == "__tensor__" else tensors[inner].numpy()
        return {k: _decode(v, tensors) for k, v in data.items()}
    return data


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key
