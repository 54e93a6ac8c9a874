"""Plain values (hyper-parameters, data positions, RNG states) as safe JSON.

No pickle: a value is made of None, bool, int, float, str, bytes, list, tuple
and dict, and numpy scalars. JSON has no tuples, bytes or non-string keys, so
those are tagged (``{"__tuple__": [...]}``, ``{"__bytes__": "<base64>"}``,
``{"__dict__": [[key, value], ...]}``); a numpy scalar keeps its dtype
(``{"__numpy__": ["float32", 0.30000001192092896]}``, format version 6).
Decoding builds only those types, and numpy scalars only of the dtypes in
:data:`NUMPY_SCALARS`, so a store from elsewhere cannot run code.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any

import numpy as np

from .errors import CorruptionError

TAGS = ("__tuple__", "__bytes__", "__dict__", "__tensor__", "__ndarray__", "__float__", "__numpy__")
PLACEHOLDERS = ("__tensor__", "__ndarray__")  # the tags whose value names a tensor item

# The dtypes of the numpy scalars that are stored (``{"__numpy__": [name, ...]}``) and the
# only ones a stored name builds: each holds its values exactly as a JSON number (a float16
# or float32 is exactly a float64). longdouble (float128) is refused: it is wider than a
# float64 and its layout differs between machines.
NUMPY_SCALARS = {name: np.dtype(name).type for name in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128")}

# The unsigned integer of the same width as each float dtype: a NaN is stored by its bits
# unless it is the dtype's own NaN (np.float32("nan")), so its sign and payload are kept.
_BITS = {np.float16: np.uint16, np.float32: np.uint32, np.float64: np.uint64}
_NAN_BITS = {t: int(t("nan").view(u)) for t, u in _BITS.items()}
_NUMPY_TYPES = {t: name for name, t in NUMPY_SCALARS.items()}
_HEX = "0123456789abcdef"

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


def check_key(key: Any, where: str) -> None:
    """Refuse a dict key that is a string UTF-8 cannot encode (a lone surrogate, as
    ``os.fsdecode`` makes of a file name that is not UTF-8): keys become parts of item
    and scalar names, which are UTF-8. ``where`` names the dict."""
    if isinstance(key, str) and not key.isascii():
        try:
            key.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise UnsupportedValueError(
                f"{where}: the dict key {key!r} is not valid Unicode (it holds a lone surrogate, "
                f"{key[exc.start]!r} at position {exc.start}) and cannot be stored: keys name the stored "
                "items, which are UTF-8; use a key of valid text (e.g. key.encode('utf-8', 'replace')"
                ".decode()), or keep such a name in a value"
            ) from None


def check_keys(d: dict, where: str) -> None:
    """:func:`check_key` of every key of ``d`` (at once when they are all ASCII)."""
    if not all(k.isascii() for k in d if isinstance(k, str)):
        for k in d:
            check_key(k, where)


def check_nesting(value: Any, where: str) -> None:
    """Refuse a structure of lists, tuples and dicts that contains itself or is nested
    deeper than :data:`MAX_DEPTH`, or holds a dict key :func:`check_key` refuses;
    ``where`` names it, its path is appended. Iterative: no recursion to run out of."""
    todo = [(value, where, ())]
    while todo:
        x, path, around = todo.pop()
        if isinstance(x, dict):
            check_keys(x, path)
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
    try:  # not np.ascontiguousarray: it makes a 0-d array 1-d
        return torch.from_numpy(array if array.flags.c_contiguous else np.ascontiguousarray(array))
    except TypeError:  # a dtype torch has no equivalent of, such as float128
        raise UnsupportedValueError(
            f"{where}: a numpy array of dtype {array.dtype} cannot be stored (torch has no such dtype)"
        ) from None


def encode(value: Any, where: str) -> Any:
    """Turn ``value`` into JSON-ready data; ``where`` names it in errors."""
    return _encode(value, where, ())


def _encode(value: Any, where: str, around: tuple[int, ...]) -> Any:
    """:func:`encode`; ``around``: the ids of the containers that hold ``value``."""
    t = type(value)
    if t is int or t is str or t is bool or value is None:  # most values: as they are
        return value
    if t is float:
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if t in _NUMPY_TYPES or isinstance(value, (np.number, np.bool_)):  # before float: np.float64 is one
        return _encode_numpy(value, where)
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        value = float(value)
        # JSON has no NaN/Infinity: keep them exact through a tag.
        return value if math.isfinite(value) else {"__float__": repr(value)}
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
        check_keys(value, where)
        if all(isinstance(k, str) for k in value) and not any(k in TAGS for k in value):
            return {k: _encode(v, f"{where}.{k}", inner) for k, v in value.items()}
        return {"__dict__": [[_encode(k, where, inner), _encode(v, f"{where}[{k!r}]", inner)]
                             for k, v in value.items()]}
    raise UnsupportedValueError(
        f"{where}: a value of type {type(value).__module__}.{type(value).__qualname__} "
        "cannot be stored without pickle; convert it to numbers, strings, lists and dicts, "
        "give it state_dict()/load_state_dict(), or register a StateProvider for its type"
    )


def _encode_numpy(value: np.number | np.bool_, where: str) -> Any:
    """``{"__numpy__": [dtype name, number]}``: decoded as the same dtype and value."""
    name = _NUMPY_TYPES.get(type(value))
    if name is None:  # another type of an allowed dtype (np.longlong: int64), or refused
        name = value.dtype.name
        kind = NON_NUMERIC_KINDS.get(value.dtype.kind)
        if kind is not None:  # np.timedelta64 is an np.signedinteger
            raise UnsupportedValueError(
                f"{where}: a numpy scalar of {kind} (dtype {name}) cannot be stored; only numbers "
                "and booleans can (convert it, e.g. with int())"
            )
        if name not in NUMPY_SCALARS:
            raise UnsupportedValueError(
                f"{where}: a numpy scalar of dtype {name} cannot be stored exactly (only "
                f"{', '.join(NUMPY_SCALARS)} can); convert it, e.g. with float()"
            )
    kind = value.dtype.kind
    if kind == "f":
        number = _float_number(value)
    elif kind in "iu":
        number = int(value)
    elif kind == "b":
        number = bool(value)
    else:  # complex
        number = [_float_number(value.real), _float_number(value.imag)]
    return {"__numpy__": [name, number]}


def _float_number(value: np.floating) -> Any:
    """A numpy float as a JSON number (exact: it widens to a float64 without rounding),
    ``{"__float__": "inf"|"-inf"|"nan"}`` for the infinities and the dtype's own NaN,
    or the hex string of its bits for any other NaN (``"0xffc00000"``)."""
    number = float(value)
    if math.isfinite(number):
        return number
    t = value.dtype.type
    bits = int(value.view(_BITS[t]))
    if not math.isnan(number) or bits == _NAN_BITS[t]:
        return {"__float__": repr(number)}
    return f"0x{bits:0{2 * value.itemsize}x}"


# The format version that made each key a tag. A dict of that one key written by an
# earlier version is a user's dict: the writer then stored it as it was.
TAG_SINCE = {"__numpy__": 6}


def as_current(data: Any, version: int) -> Any:
    """Values written by format ``version`` in the encoding :func:`decode` reads now:
    a one-key dict whose key became a tag after ``version`` in the ``__dict__`` form."""
    later = frozenset(tag for tag, since in TAG_SINCE.items() if version < since)
    return _escaped(data, later) if later else data


def _escaped(data: Any, tags: frozenset) -> Any:
    if isinstance(data, list):
        return [_escaped(v, tags) for v in data]
    if isinstance(data, dict):
        if len(data) == 1 and next(iter(data)) in tags:
            (key, inner), = data.items()
            return {"__dict__": [[key, _escaped(inner, tags)]]}
        return {k: _escaped(v, tags) for k, v in data.items()}
    return data


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
            if tag == "__numpy__":
                return decode_numpy(inner)
            if tag == "__dict__":
                return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in inner}
            if tag in PLACEHOLDERS:
                if tensors is None or inner not in tensors:
                    raise KeyError(f"the value refers to tensor {inner!r}, which was not loaded")
                return tensors[inner] if tag == "__tensor__" else tensors[inner].numpy()
        return {k: _decode(v, tensors) for k, v in data.items()}
    return data


def decode_numpy(inner: Any) -> np.number | np.bool_:
    """The numpy scalar of a ``{"__numpy__": inner}`` tag; only the dtypes of
    :data:`NUMPY_SCALARS`, and only values they hold exactly (``ValueError`` otherwise)."""
    if not (isinstance(inner, list) and len(inner) == 2 and isinstance(inner[0], str)):
        raise ValueError(f"a numpy scalar is stored as {_short(inner)}, not [dtype, number]")
    name, number = inner
    kind = NUMPY_SCALARS.get(name)
    if kind is None:
        raise ValueError(f"a numpy scalar of dtype {_short(name)}, not one of the dtypes stored "
                         f"({', '.join(NUMPY_SCALARS)})")
    if kind is np.bool_:
        if type(number) is not bool:
            raise ValueError(f"a numpy bool stored as {_short(number)}")
        return np.bool_(number)
    if issubclass(kind, np.integer):
        info = np.iinfo(kind)
        if type(number) is not int or not info.min <= number <= info.max:
            raise ValueError(f"a numpy {name} stored as {_short(number)}, not an integer it holds")
        return kind(number)
    if issubclass(kind, np.complexfloating):
        if not (isinstance(number, list) and len(number) == 2):
            raise ValueError(f"a numpy {name} stored as {_short(number)}, not [real, imaginary]")
        part = np.float32 if kind is np.complex64 else np.float64
        # the parts' bits side by side (kind(real + 1j * imag) would make an infinite part's 0 * inf NaN)
        return np.array([_decode_float(part, v) for v in number], dtype=part).view(kind)[0]
    return _decode_float(kind, number)


def _decode_float(kind: type, number: Any) -> np.floating:
    if type(number) in (int, float):
        try:
            with np.errstate(over="ignore"):
                value = kind(number)
        except OverflowError:  # an int beyond a float64's range
            value = None
        if value is not None and float(value) == number:  # a number the dtype holds exactly
            return value
    elif isinstance(number, dict) and len(number) == 1 and number.get("__float__") in ("inf", "-inf", "nan"):
        return kind(number["__float__"])
    elif (isinstance(number, str) and len(number) == 2 + 2 * np.dtype(kind).itemsize and number.startswith("0x")
          and not number[2:].strip(_HEX)):
        value = _BITS[kind](int(number[2:], 16)).view(kind)
        if np.isnan(value):  # a NaN by its bits; other values are numbers
            return value
    raise ValueError(f"a numpy {np.dtype(kind).name} stored as {_short(number)}, not a number it holds")


def _short(x: Any) -> str:
    shown = repr(x)
    return shown if len(shown) <= 60 else shown[:60] + "..."


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key
