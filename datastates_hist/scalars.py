"""Scalars: the plain numbers written with a step, by name.

Every number among a step's plain values (``data={"loss": 1.2}``, a
scheduler's state, each optimizer param group's options) is a scalar, named by
its path in the values: ``extra/data/loss``, ``extra/scheduler/_last_lr/0``,
``optim/param_groups/0/lr``. A provider's wrapper is left out of the path (the
``{"type", "state"}`` of a ``state_dict()`` object, the ``groups[i].options``
of an optimizer). numpy scalars count as the numbers they equal (complex ones
do not). Bools count as numbers (0 and 1); strings, bytes, None and
RNG states are not scalars, nor are lists longer than :data:`MAX_LIST` (a
series, not a handful of settings). The commit records them in the index
(docs/format.md); :class:`~datastates_hist.history.History` reads them.

This module works on the encoded values of :mod:`.values` (the manifest's
``values.items``), so that it needs neither the tensors nor a decode.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
from typing import Any, Iterator

import numpy as np

from .items import under
from .values import decode_numpy

# Names a scalar may be given by, shortest first: ``loss`` for ``extra/data/loss``.
SHORT_PREFIXES = ("extra/data/", "extra/")

# A list or tuple of more numbers than this is a series, not scalars.
MAX_LIST = 32

# The value items that are not scalars: RNG states (hundreds of integers).
NOT_SCALARS = "rng"

INT64 = 2 ** 63


def scalars_of(items: dict[str, Any]) -> dict[str, int | float]:
    """``{name: number}`` of every scalar in ``items`` (the encoded ``values["items"]``
    of a step): ints as ints (beyond 64 bits as floats), bools as 0/1, floats with NaN
    and infinities kept."""
    out: dict[str, int | float] = {}
    for item, value in items.items():
        if under(item, NOT_SCALARS):
            continue
        for path, number in _numbers(_unwrapped(value), item):
            out[path] = number
    return out


def _unwrapped(value: Any) -> Any:
    """The state inside a provider's wrapper: an object's ``state``, an optimizer's
    options per group; ``value`` itself otherwise."""
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        if set(value) == {"type", "state"}:
            return value["state"]
        groups = value.get("groups")
        if set(value) == {"type", "groups"} and isinstance(groups, list) and all(
                isinstance(g, dict) and "options" in g for g in groups):
            return [g["options"] for g in groups]
    return value


def _numbers(value: Any, path: str, depth: int = 0) -> Iterator[tuple[str, int | float]]:
    if depth > 100:  # values.MAX_DEPTH: deeper was refused when written
        return
    if isinstance(value, bool):
        yield path, int(value)
    elif isinstance(value, int):
        if -INT64 <= value < INT64:
            yield path, value
        else:  # the index holds it as a float; beyond a float's range, as an infinity
            try:
                yield path, float(value)
            except OverflowError:
                yield path, math.inf if value > 0 else -math.inf
    elif isinstance(value, float):
        yield path, value
    elif isinstance(value, list):
        if len(value) <= MAX_LIST:
            for i, v in enumerate(value):
                yield from _numbers(v, f"{path}/{i}", depth + 1)
    elif isinstance(value, dict):
        if len(value) == 1:
            (tag, inner), = value.items()
            if tag == "__float__":
                try:
                    yield path, float(inner)
                except (TypeError, ValueError):
                    pass  # a malformed tag names no number
                return
            if tag == "__numpy__":  # a numpy scalar: as the Python number it equals
                try:
                    number = decode_numpy(inner)
                except (TypeError, ValueError):
                    return  # a malformed tag names no number
                if not isinstance(number, np.complexfloating):  # SQLite has no complex numbers
                    yield from _numbers(number.item(), path, depth)
                return
            if tag == "__tuple__":
                yield from _numbers(inner, path, depth)
                return
            if tag in ("__bytes__", "__tensor__", "__ndarray__"):
                return
            if tag == "__dict__":
                pairs = inner if isinstance(inner, list) else []
                for pair in pairs:
                    if isinstance(pair, list) and len(pair) == 2:
                        key = _numpy_key(pair[0])
                        if isinstance(key, (str, int)):
                            yield from _numbers(pair[1], f"{path}/{key}", depth + 1)
                return
        for key, v in value.items():
            yield from _numbers(v, f"{path}/{key}", depth + 1)


def _numpy_key(key: Any) -> Any:
    """A dict key as its path part: a numpy integer key (``{"__numpy__": ["int64", 3]}``)
    as the Python int it equals, as such keys were stored before format version 6."""
    if isinstance(key, dict) and len(key) == 1 and "__numpy__" in key:
        try:
            number = decode_numpy(key["__numpy__"])
        except (TypeError, ValueError):
            return None
        return number.item() if isinstance(number, (np.integer, np.bool_)) else None
    return key


def short_forms(name: str) -> list[str]:
    """The names ``name`` may also be given by (``loss`` for ``extra/data/loss``)."""
    return [name[len(p):] for p in SHORT_PREFIXES if name.startswith(p)]


def matches_scalar(name: str, patterns: list[str]) -> bool:
    """Whether a glob of ``patterns`` matches the stored scalar name or a short form of it."""
    return any(fnmatch.fnmatchcase(n, p) for n in (name, *short_forms(name)) for p in patterns)


def resolve_scalar(name: str, known: list[str]) -> str | None:
    """The stored scalar name ``name`` stands for among ``known``: itself, or the first
    of ``extra/data/NAME``, ``extra/NAME`` held; None when none is."""
    have = set(known)
    return next((n for n in (name, *(p + name for p in SHORT_PREFIXES)) if n in have), None)


def close_hint(name: str, known: list[str]) -> str:
    """``"; close names: a, b"`` for an error about ``name``, or ``""`` when none is close."""
    close = close_names(name, known)
    return f"; close names: {', '.join(close)}" if close else ""


def close_names(name: str, known: list[str], n: int = 3) -> list[str]:
    """Up to ``n`` of ``known`` that look like ``name`` (compared by full and short names)."""
    by_form = {}
    for k in known:
        for form in (k, *short_forms(k), k.rsplit("/", 1)[-1]):
            by_form.setdefault(form, k)
    found = []
    for form in difflib.get_close_matches(name, list(by_form), n=n * 3, cutoff=0.6):
        if by_form[form] not in found:
            found.append(by_form[form])
    return found[:n]
