"""State Providers: how objects become named items, and how they are loaded back.

A provider describes *what* is saved; it never moves bytes. The Checkpointer
prefixes the names a provider gives (``model/``, ``optim/``, ``extra/<key>/``,
``rng/``) and hands the tensors to the snapshot engine.

Restore runs in two phases so that a strict restore changes nothing when any
target does not match: :meth:`StateProvider.check` for every target first,
then :meth:`StateProvider.load`. A non-strict restore loads no target whose
problems concern it whole (:meth:`StateProvider.leaves_unloaded`).

This module holds the protocol, the registry and the fallbacks for any object;
the providers of torch's modules, optimizers and RNG states are registered by
:mod:`.torch_providers`, which :mod:`.collect` and :mod:`.restore` import.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping
from urllib.parse import quote

import numpy as np
import torch

from . import values
from .items import TensorItem, TensorRecord, ValueItem

Item = TensorItem | ValueItem


@dataclass
class Context:
    """What providers share within one write or restore.

    Attributes:
        param_names: ``id(parameter)`` -> its fully qualified name in the model,
            so that optimizer state is keyed by names, not positions.
    """

    param_names: dict[int, str] = field(default_factory=dict)


@dataclass
class Problems:
    """What a target expects and the stored step does not give (or the reverse)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched)

    def extend(self, other: "Problems", prefix: str) -> None:
        """Add the problems of the object at ``prefix`` (its names are relative to it)."""
        full = lambda n: f"{prefix}/{n}" if n else prefix  # noqa: E731 -- "" names the object itself
        self.missing += [full(n) for n in other.missing]
        self.unexpected += [full(n) for n in other.unexpected]
        self.mismatched += [(full(n), e, f) for n, e, f in other.mismatched]


class StoredState:
    """The stored items under one prefix, as a provider sees them on restore.

    Attributes:
        records: relative tensor name -> its :class:`TensorRecord`.
        values: relative value name -> the decoded-JSON data.
    """

    def __init__(self, records: dict[str, TensorRecord], values_: dict[str, Any],
                 read: Callable[[str], torch.Tensor], read_box: Callable | None = None):
        self.records, self.values, self._read, self._read_box = records, values_, read, read_box

    def tensor(self, name: str) -> torch.Tensor:
        """Read tensor ``name`` (checksum verified) into host memory."""
        return self._read(name)

    def box(self, name: str, start: tuple[int, ...], count: tuple[int, ...]) -> torch.Tensor:
        """The box ``start``/``count`` of tensor ``name`` (its blocks' checksums verified);
        a provider of shards reads its own block this way."""
        if self._read_box is None:
            index = tuple(slice(s, s + c) for s, c in zip(start, count))
            return self.tensor(name)[index].clone()
        return self._read_box(name, start, count)

    def tensor_like(self, name: str, live: Any) -> torch.Tensor:
        """Tensor ``name`` in the form of ``live``: for a DTensor of the same global
        shape, only this rank's shard is read (a DTensor with ``live``'s placements)."""
        from .sharding import is_dtensor, local_box

        rec = self.records[name]
        if not is_dtensor(live) or rec.shape != tuple(live.shape) or self._read_box is None:
            return self.tensor(name)
        from torch.distributed.tensor import DTensor

        offset, shape = local_box(live)
        local = self.box(name, offset, shape).to(live.device)
        return DTensor.from_local(local, live.device_mesh, live.placements, run_check=False,
                                  shape=live.shape, stride=live.stride())


class StateProvider(ABC):
    """Turns objects of some type into items, and loads items back into them.

    Attributes:
        kind: the name a step's manifest records for the objects this provider
            saved (``values.objects``). A class's own name unless the class sets
            it; the built-in providers set it, so that renaming a class keeps the
            steps written before readable.
    """

    kind: str

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "kind" not in cls.__dict__:
            cls.kind = cls.__name__

    @abstractmethod
    def items(self, obj: Any, ctx: Context) -> Iterable[Item]:
        """The items of ``obj``, with names relative to its prefix."""

    def check(self, obj: Any, state: StoredState, ctx: Context) -> Problems:
        """What would not load; the default compares with :meth:`items`."""
        return compare(self.items(obj, ctx), state)

    def leaves_unloaded(self, problems: Problems) -> bool:
        """Whether a non-strict restore leaves ``obj`` as it was, given what :meth:`check`
        found: by default any problem does (all or nothing, as ``load_state_dict``);
        providers that load item by item override it."""
        return bool(problems)

    @abstractmethod
    def load(self, obj: Any, state: StoredState, ctx: Context) -> Any:
        """Load what matches into ``obj`` (in place where it can) and return the result.
        Called only when :meth:`leaves_unloaded` is false."""

    def destinations(self, obj: Any, ctx: Context) -> dict[str, torch.Tensor]:
        """Live CPU tensors of ``obj`` that restore may read straight into (by relative
        name), before :meth:`load`; ``state.tensor`` then returns them. None by default."""
        return {}


# a tensor that copy_() cannot load into, as a mismatch names it: (expected, found)
EXPANDED = ("a tensor to load into", "an expanded tensor whose elements share memory: clone() it first")


def expanded(t: torch.Tensor) -> bool:
    """Whether several elements of ``t`` are one in memory (a stride of 0, as ``expand``
    makes): ``copy_`` into it fails."""
    return any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape))


def compare(expected: Iterable[Item], state: StoredState) -> Problems:
    """Missing, unexpected and mismatched tensors between expected items and a stored state."""
    problems = Problems()
    want = {i.name: i.tensor for i in expected if isinstance(i, TensorItem)}
    for name, tensor in want.items():
        rec = state.records.get(name)
        if rec is None:
            problems.missing.append(name)
        elif rec.shape != tuple(tensor.shape) or rec.dtype != _dtype_str(tensor):
            problems.mismatched.append(
                (name, f"{_dtype_str(tensor)}{list(tensor.shape)}", f"{rec.dtype}{list(rec.shape)}")
            )
    problems.unexpected += [n for n in state.records if n not in want]
    return problems


def _compare_array(array: np.ndarray, state: StoredState) -> Problems:
    """:func:`compare` for a numpy array loaded in place (not copied to be compared): the
    stored tensor of its shape (a 0-d one: ``[]``, or ``[1]`` as written before format 6)
    and of its dtype in native order."""
    problems, rec = Problems(), state.records.get("")
    try:
        dtype = _dtype_str(torch.from_numpy(np.empty(0, array.dtype.newbyteorder("="))))
    except TypeError:  # a dtype no tensor has (so none stored)
        dtype = str(array.dtype)
    shapes = (array.shape, (1,)) if array.ndim == 0 else (array.shape,)
    if rec is None:
        problems.missing.append("")
    elif rec.shape not in shapes or rec.dtype != dtype:
        problems.mismatched.append(("", f"{dtype}{list(array.shape)}", f"{rec.dtype}{list(rec.shape)}"))
    problems.unexpected += [n for n in state.records if n != ""]
    return problems


def _dtype_str(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def matching(expected: Mapping[str, torch.Tensor], state: StoredState) -> list[str]:
    """Names whose stored shape and dtype equal the expected tensor's."""
    out = []
    for name, t in expected.items():
        rec = state.records.get(name)
        if rec is not None and rec.shape == tuple(t.shape) and rec.dtype == _dtype_str(t):
            out.append(name)
    return out


# --- nested structures of values and tensors -------------------------------------------

@functools.lru_cache(maxsize=1 << 14)  # keys repeat across a state dict (exp_avg, step, 0, 1, ...)
def _quoted(key: str) -> str:
    return quote(key, safe="")


def _child(name: str, key: str) -> str:
    """The name of entry ``key`` inside ``name``: its path, each part percent-quoted."""
    return f"{name}/{_quoted(key)}" if name else _quoted(key)


def flatten(obj: Any, where: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split a nested structure into safe JSON data with placeholders, and its tensors."""
    tensors: dict[str, torch.Tensor] = {}
    values.check_nesting(obj, where)  # walk() recurses

    def add(name: str, t: torch.Tensor) -> None:
        if name in tensors:  # keys 1 and "1" of one dict: both would be stored as one
            raise values.NameClashError(f"{where}/{name}: two entries would be stored under this name "
                                        "(keys that differ only in type, such as 1 and '1')")
        tensors[name] = t

    def walk(x: Any, name: str) -> Any:
        if isinstance(x, torch.Tensor):
            add(name, x.detach())
            return {"__tensor__": name}
        if isinstance(x, np.ndarray) and x.dtype != object:
            add(name, values.array_tensor(x, f"{where}/{name}" if name else where))
            return {"__ndarray__": name}
        if isinstance(x, dict):
            if all(isinstance(k, str) for k in x) and not any(k in values.TAGS for k in x):
                return {k: walk(v, _child(name, k)) for k, v in x.items()}
            return {"__dict__": [[values.encode(k, where), walk(v, _child(name, str(k)))]
                                 for k, v in x.items()]}
        if isinstance(x, list):
            return [walk(v, _child(name, str(i))) for i, v in enumerate(x)]
        if isinstance(x, tuple):
            return {"__tuple__": [walk(v, _child(name, str(i))) for i, v in enumerate(x)]}
        return values.encode(x, f"{where}/{name}" if name else where)

    return walk(obj, ""), tensors


def flatten_under(value: Any, base: str, where: str, add: Callable[[str, torch.Tensor], None]) -> Any:
    """``value`` as safe JSON data (:func:`flatten`), each tensor (or numeric array) in it a
    placeholder naming the tensor item ``<base>/<path>``, handed to ``add(name, tensor)``
    (a value that is a tensor itself is the item ``base``)."""
    data, found = flatten(value, where)
    if not found:
        return data
    for rel, t in found.items():
        add(f"{base}/{rel}" if rel else base, t)
    return _renamed(data, base)


def _renamed(data: Any, base: str) -> Any:
    """``data`` with each placeholder's name put under ``base``."""
    if isinstance(data, list):
        return [_renamed(v, base) for v in data]
    if isinstance(data, dict):
        if len(data) == 1:
            (tag, inner), = data.items()
            if tag in values.PLACEHOLDERS and isinstance(inner, str):
                return {tag: f"{base}/{inner}" if inner else base}
        return {k: _renamed(v, base) for k, v in data.items()}
    return data


def placeholders(data: Any) -> list[str]:
    """The tensor item names of the placeholders in stored value ``data`` (iterative: no
    recursion to run out of on a crafted value)."""
    out, todo = [], [data]
    while todo:
        x = todo.pop()
        if isinstance(x, list):
            todo.extend(x)
        elif isinstance(x, dict):
            if len(x) == 1 and next(iter(x)) in values.PLACEHOLDERS:
                out.append(str(next(iter(x.values()))))
            else:
                todo.extend(x.values())
    return out


def decoded(state: StoredState, data: Any) -> Any:
    """Stored value ``data`` with its placeholders' tensors read from ``state``."""
    return values.decode(data, {name: state.tensor(name) for name in placeholders(data)})


class TreeProvider(StateProvider):
    """Plain values, tensors, arrays, and dicts/lists/tuples of them."""

    kind = "TreeProvider"

    def items(self, obj, ctx):
        skeleton, tensors = flatten(obj, "value")
        yield ValueItem("", skeleton)
        for name, t in tensors.items():
            yield TensorItem(name, t, volatile=True)

    def load(self, obj, state, ctx):
        skeleton = state.values.get("")
        tensors = {n: state.tensor(n) for n in state.records}
        restored = values.decode(skeleton, tensors)
        if isinstance(obj, torch.Tensor) and isinstance(restored, (torch.Tensor, np.ndarray)):
            with torch.no_grad():
                obj.copy_(torch.as_tensor(restored))
            return obj
        if isinstance(obj, np.ndarray) and isinstance(restored, (torch.Tensor, np.ndarray)) and obj.flags.writeable:
            restored = restored.numpy() if isinstance(restored, torch.Tensor) else restored
            np.copyto(obj, restored.reshape(obj.shape))  # a 0-d array written before format 6 has shape [1]
            return obj
        return restored

    def check(self, obj, state, ctx):
        problems = Problems()
        if "" not in state.values:
            problems.missing.append("")
        if isinstance(obj, torch.Tensor):  # loaded in place: of the stored shape and dtype
            problems = compare(self.items(obj, ctx), state)
            problems.mismatched += [("", *EXPANDED)] if expanded(obj) else []
        elif isinstance(obj, np.ndarray):
            problems = _compare_array(obj, state)
        return problems


class StateDictProvider(StateProvider):
    """Anything with ``state_dict()`` / ``load_state_dict()`` (schedulers, samplers, GradScaler)."""

    kind = "StateDictProvider"

    def items(self, obj, ctx):
        skeleton, tensors = flatten(obj.state_dict(), type(obj).__name__)
        yield ValueItem("", {"type": type(obj).__qualname__, "state": skeleton})
        for name, t in tensors.items():
            yield TensorItem(name, t, volatile=True)

    def check(self, obj, state, ctx):
        problems = Problems()
        stored = state.values.get("")
        if stored is None:
            problems.missing.append("")
        elif stored.get("type") != type(obj).__qualname__:
            problems.mismatched.append(("", type(obj).__qualname__, str(stored.get("type"))))
        return problems

    def load(self, obj, state, ctx):
        tensors = {n: state.tensor(n) for n in state.records}
        obj.load_state_dict(values.decode(state.values[""]["state"], tensors))
        return obj


# --- the registry ------------------------------------------------------------------------

_REGISTRY: dict[type, StateProvider] = {}


def register_provider(cls: type, provider: StateProvider) -> None:
    """Use ``provider`` for objects of ``cls`` and its subclasses."""
    if not isinstance(provider, StateProvider):
        raise TypeError(f"{provider!r} is not a StateProvider")
    _REGISTRY[cls] = provider


def provider_for(obj: Any) -> StateProvider:
    """The provider registered for ``obj``'s type (by MRO), else a generic one."""
    for cls in type(obj).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return _STATE_DICT
    return _TREE


_STATE_DICT = StateDictProvider()
_TREE = TreeProvider()


def rebuild(state: StoredState, kind: str) -> Any:
    """An object saved by a provider of ``kind``, rebuilt without a live object to load
    into (an extra not passed to restore): a state dict, a value, or else its items
    by relative name (values decoded, tensors read)."""
    tensors = {n: state.tensor(n) for n in state.records}
    if kind == StateDictProvider.kind:
        return values.decode(state.values[""]["state"], tensors)
    if kind == TreeProvider.kind:
        return values.decode(state.values[""], tensors)
    return {**{n: values.decode(v, tensors) for n, v in state.values.items()}, **tensors}
