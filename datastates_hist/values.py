"""Plain values (hyper-parameters, data positions, RNG states) as safe JSON.

No pickle: a value is made of None, bool, int, float, str, bytes, list, tuple
and dict, and numpy scalars. JSON has no tuples, bytes or non-string keys, so
those are tagged (``{"__tuple__": [...]}``, ``{"__bytes__": "<base64>"}``,
``{"__dict__": [[key, value], ...]}``). Decoding builds only those types, so
a store from elsewhere cannot run code.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np

TAGS = ("__tuple__", "__bytes__", "__dict__", "__tensor__", "__ndarray__", "__float__")


class UnsupportedValueError(TypeError):
    """A value has a type that cannot be stored without pickle."""


def encode(value: Any, where: str) -> Any:
    """Turn ``value`` into JSON-ready data; ``where`` names it in errors."""
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
        items = (list(value) if all(type(v) is int for v in value)
                 else [encode(v, f"{where}[{i}]") for i, v in enumerate(value)])
        return items if isinstance(value, list) else {"__tuple__": items}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k in TAGS for k in value):
            return {k: encode(v, f"{where}.{k}") for k, v in value.items()}
        return {"__dict__": [[encode(k, where), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise UnsupportedValueError(
        f"{where}: a value of type {type(value).__module__}.{type(value).__qualname__} "
        "cannot be stored without pickle; convert it to numbers, strings, lists and dicts, "
        "give it state_dict()/load_state_dict(), or register a StateProvider for its type"
    )


def decode(data: Any, tensors: dict | None = None) -> Any:
    """Rebuild a value from :func:`encode`'s output.

    ``tensors`` maps the names of ``{"__tensor__": name}`` placeholders to the
    tensors that replace them.
    """
    if isinstance(data, list):
        return [decode(v, tensors) for v in data]
    if isinstance(data, dict):
        if len(data) == 1:
            (tag, inner), = data.items()
            if tag == "__tuple__":
                return tuple(decode(v, tensors) for v in inner)
            if tag == "__bytes__":
                return base64.b64decode(inner)
            if tag == "__float__":
                return float(inner)
            if tag == "__dict__":
                return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in inner}
            if tag in ("__tensor__", "__ndarray__"):
                if tensors is None or inner not in tensors:
                    raise KeyError(f"the value refers to tensor {inner!r}, which was not loaded")
                return tensors[inner] if tag == "__tensor__" else tensors[inner].numpy()
        return {k: decode(v, tensors) for k, v in data.items()}
    return data


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def dumps(data: Any) -> bytes:
    """Serialise encoded data; NaN is refused since :func:`encode` tags it."""
    return json.dumps(data, allow_nan=False, separators=(",", ":")).encode()


def loads(raw: bytes) -> Any:
    return json.loads(raw)
