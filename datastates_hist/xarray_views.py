"""xarray views of a history: lazy arrays of tensors over steps.

``History.to_xarray(name, steps=...)`` gives one tensor as a lazy
``xarray.DataArray`` with dims ``(step, dim_0, ...)`` (:func:`tensor_dataarray`);
the ``datastates`` engine (:mod:`.xarray_backend`) gives every tensor as a
variable over ``step`` (:func:`open_history_dataset`). Both read through
:meth:`History.read`, so only the selection asked for is read, from any backend.

Every function takes an open :class:`~datastates_hist.history.History` as
``history``; this module does not import it, since ``History.to_xarray`` imports
this module (when called: ``import datastates_hist`` imports no xarray).

Names in a dataset (docs/format.md): a variable is named by the stored name with
``/`` replaced by ``.`` (``model.blocks.0.attn.weight``, ``optim.state.blocks.0.attn.weight.exp_avg``,
``extra.data.loss``), and its ``long_name`` attribute holds the stored name; axis
``i`` of length ``n`` of a tensor is the dimension ``dim{i}_{n}``, shared by every
tensor with that length on that axis (a layer's weight, its bias and its optimizer
state line up), never repeated within one variable.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
import weakref
from collections import Counter
from typing import Any, Iterable

import numpy as np
import pandas as pd
import torch
import xarray as xr
from xarray.backends import BackendArray
from xarray.core import indexing

from .dtypes import torch_dtype
from .errors import CorruptionError, ShapeChangeError, StepNotFoundError
from .items import TensorRecord, selected, selected_names
from .layout import asked_step
from .scalars import close_hint, matches_scalar, resolve_scalar

# Dtypes numpy lacks (bfloat16, float8) or that most numpy code handles poorly (float16).
_WIDENED = {torch.bfloat16, torch.float16} | {
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)}

# One lock per History: its step cache, SQLite connection and readers are not thread-safe,
# and dask's threaded scheduler calls __getitem__ from several threads.
_LOCKS: "weakref.WeakKeyDictionary[object, threading.Lock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _lock(history) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(history, threading.Lock())


def numpy_dtype(dtype_name: str) -> np.dtype:
    """The numpy dtype xarray sees for a stored torch dtype (float32 for 16- and 8-bit floats)."""
    dtype = torch_dtype(dtype_name)
    if dtype in _WIDENED:
        return np.dtype("float32")
    return torch.empty(0, dtype=dtype).numpy().dtype


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float32).numpy() if t.dtype in _WIDENED else t.numpy()


def _selected_len(key: Any, n: int) -> int | None:
    """Length of dimension ``n`` after ``key``; None when an int drops the dimension."""
    if isinstance(key, slice):
        return len(range(*key.indices(n)))
    if isinstance(key, np.ndarray):
        return len(key)
    return None


class TensorArray(BackendArray):
    """One tensor over a list of steps, read lazily selection by selection.

    Args:
        history: the open run.
        name: the tensor's stored name (``model/...``).
        steps: the steps, in order; the tensor has ``shape`` and ``dtype`` at each.
        shape: the tensor's shape.
        dtype_name: the tensor's torch dtype name as recorded.
    """

    def __init__(self, history, name: str, steps: list[int], shape: tuple[int, ...],
                 dtype_name: str):
        self.history, self.name, self.steps = history, name, list(steps)
        self.tensor_shape = tuple(shape)
        self.shape = (len(self.steps), *self.tensor_shape)
        self.dtype = numpy_dtype(dtype_name)
        self.lock = _lock(history)

    def __getitem__(self, key: indexing.ExplicitIndexer) -> np.ndarray:
        # OUTER: step lists (isel(step=[...])) read only those steps, not their span.
        return indexing.explicit_indexing_adapter(
            key, self.shape, indexing.IndexingSupport.OUTER, self._raw_getitem)

    def _raw_getitem(self, key: tuple) -> np.ndarray:
        step_key, tensor_key = key[0], tuple(key[1:])
        read_key, post = self._box_key(tensor_key)
        full = all(isinstance(k, slice) and k.indices(n) == (0, n, 1)
                   for k, n in zip(read_key, self.tensor_shape))
        positions = (range(len(self.steps))[step_key] if isinstance(step_key, slice)
                     else np.asarray(step_key).reshape(-1))
        sizes = [s for s in (_selected_len(k, n) for k, n in zip(tensor_key, self.tensor_shape))
                 if s is not None]
        out = None
        with self.lock:
            for i, pos in enumerate(positions):
                # A whole tensor is read with its checksum checked; a part reads only its box.
                step = self.steps[int(pos)]
                arr = self._post(_to_numpy(self.history.read(self.name, step, index=None if full else read_key)),
                                 post)
                if out is None:
                    # allocated once a step is read: the read checks the index's shape against the
                    # step's manifest and its unit's bytes, so a crafted shape asks for no memory
                    if arr.shape != tuple(sizes):
                        raise CorruptionError(f"step {step} in {self.history.path}: tensor {self.name!r} was read "
                                              f"as {list(arr.shape)}, the index says {list(sizes)}")
                    out = np.empty((len(positions), *sizes), dtype=self.dtype)
                out[i] = arr
        if out is None:  # no step selected: nothing to read (sizes are bounded by the checks of _layout)
            out = np.empty((0, *sizes), dtype=self.dtype)
        return out[0] if isinstance(step_key, (int, np.integer)) else out

    def _box_key(self, tensor_key: tuple) -> tuple[tuple, list]:
        """Ints and slices for ``History.read``; an index array becomes its bounding slice."""
        read_key, post = [], []
        for k in tensor_key:
            if isinstance(k, np.ndarray):
                lo = int(k.min()) if k.size else 0
                hi = int(k.max()) + 1 if k.size else 0
                read_key.append(slice(lo, hi))
                post.append(k - lo)
            else:
                read_key.append(int(k) if isinstance(k, np.integer) else k)
                post.append(None if isinstance(k, slice) else "drop")
        return tuple(read_key), post

    @staticmethod
    def _post(arr: np.ndarray, post: list) -> np.ndarray:
        axis = 0
        for p in post:
            if isinstance(p, str):  # an int index: the axis is gone
                continue
            if p is not None:
                arr = np.take(arr, p, axis=axis)
            axis += 1
        return arr


# --- the layout of a run: which tensor has which shape at which step ------------------------

def select_steps(history, steps: Any) -> list[int]:
    """Committed steps chosen by value: None (all), a slice, an int, or a list.

    ``slice(0, 1000, 10)`` means the committed steps among 0, 10, 20, ..., 990;
    a step listed explicitly must be committed, and listed once (a step coordinate
    holds each step once: ``sel(step=...)`` takes one value).
    """
    committed = history.steps
    if steps is None:
        return committed
    if isinstance(steps, slice):
        start, stop, stride = (None if v is None else asked_step(v) for v in (steps.start, steps.stop, steps.step))
        start, stride = start or 0, 1 if stride is None else stride
        if stride <= 0:
            raise ValueError(f"a slice of steps must go forward, got step={stride}")
        return [s for s in committed if s >= start and (stop is None or s < stop) and (s - start) % stride == 0]
    if isinstance(steps, (int, np.integer)):
        steps = [steps]
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
        raise TypeError(f"steps: None, a slice, a step or a list of steps, got {steps!r}")
    chosen = [asked_step(s) for s in steps]
    repeated = sorted(s for s, n in Counter(chosen).items() if n > 1)
    if repeated:
        raise ValueError(f"steps {repeated} are listed more than once: list each step once")
    have = set(committed)
    missing = [s for s in chosen if s not in have]
    if missing:
        span = f"{committed[0]}..{committed[-1]} ({len(committed)})" if committed else "none"
        raise StepNotFoundError(f"steps {missing} are not committed in {history.path} "
                                f"(committed steps: {span})")
    return chosen


def _layout(history, steps: list[int], name: str | None = None) -> dict[str, dict[int, tuple]]:
    """``{name: {step: (dtype, shape)}}`` from the index, for ``steps`` (no tensor data read)."""
    if not steps:
        return {}
    # One query rather than one per step: a long history has thousands of steps.
    sql = "SELECT step, name, dtype, shape, nbytes FROM tensors WHERE step BETWEEN ? AND ?"
    args: list = [min(steps), max(steps)]
    if name is not None:
        sql += " AND name=?"
        args.append(name)
    wanted = set(steps)
    out: dict[str, dict[int, tuple]] = {}
    for step, tname, dtype, shape, nbytes in history.store.index.conn.execute(sql + " ORDER BY rowid", args):
        if step in wanted:
            out.setdefault(tname, {})[step] = (dtype, _checked_shape(history, step, tname, dtype, shape, nbytes))
    return out


def _checked_shape(history, step: int, name, dtype, shape: str, nbytes) -> tuple[int, ...]:
    """The shape of an index row, checked as every reader of the index checks a record
    (:meth:`TensorRecord.check`): integer dimensions, a known dtype, bytes that agree."""
    try:
        dims = json.loads(shape)
        TensorRecord(name, dtype, tuple(dims) if isinstance(dims, list) else dims, nbytes).check(indexed=True)
    except (ValueError, TypeError) as exc:
        index = history.store.index
        why = exc if isinstance(exc, ValueError) and not isinstance(exc, json.JSONDecodeError) else (
            f"tensor {name!r} has the shape {shape!r}, not a JSON list")
        raise CorruptionError(f"the index {index.path} is damaged: step {step}: {why} (rebuild it from the "
                              f"step data with: datastates-hist repair {index.run_dir})") from None
    return tuple(dims)


def _changes(per_step: dict[int, tuple]) -> list[str]:
    """Where the (dtype, shape) of a tensor changes, as ``"[4, 3] float32 -> [5, 3] float32 at step 7"``."""
    out, prev = [], None
    for step in sorted(per_step):
        dtype, shape = per_step[step]
        if prev is not None and (dtype, shape) != prev:
            out.append(f"{list(prev[1])} {prev[0]} -> {list(shape)} {dtype} at step {step}")
        prev = (dtype, shape)
    return out


def _times(history, steps: list[int]) -> np.ndarray:
    wall = {r.step: r.time for r in history.store.index.step_rows()}
    if any(s not in wall for s in steps):  # pruned by a writer since the steps were chosen
        raise StepNotFoundError(f"steps {[s for s in steps if s not in wall]} were removed from {history.path}")
    return pd.to_datetime([wall[s] for s in steps], unit="s").values


def _variable(history, name: str, steps: list[int], dtype: str, shape: tuple,
              dims: tuple[str, ...]) -> xr.Variable:
    arr = TensorArray(history, name, steps, shape, dtype)
    attrs = {"long_name": name, "dtype": dtype, "shape": list(shape)}
    # One step per chunk, the whole tensor otherwise: how each step stores it.
    encoding = {"preferred_chunks": dict(zip(dims, (1, *shape)))}
    return xr.Variable(dims, indexing.LazilyIndexedArray(arr), attrs=attrs, encoding=encoding)


def _coords(history, steps: list[int]) -> dict:
    time = xr.Variable("step", _times(history, steps), {"long_name": "commit wall time (UTC)"})
    # float seconds: netCDF3 (to_netcdf's default without netCDF4) has no 64-bit integers
    time.encoding = {"units": "seconds since 1970-01-01", "dtype": "float64"}
    return {"step": ("step", np.asarray(steps, dtype=np.int64), {"long_name": "training step"}),
            "time": time}


def scalar_dataarray(history, series: pd.Series, steps: Any = None) -> xr.DataArray:
    """A scalar (``History.scalar``'s Series) over ``steps`` (as for :func:`tensor_dataarray`)
    as a DataArray with dim ``step``."""
    explicit = steps is not None and not isinstance(steps, slice)
    chosen = select_steps(history, steps)
    missing = [s for s in chosen if s not in series.index]
    if missing and explicit:
        raise KeyError(f"scalar {series.name!r} is not in steps {missing} of {history.path}")
    chosen = [s for s in chosen if s in series.index]
    return xr.DataArray(_scalar_variable(series.name, series.loc[chosen].to_numpy()),
                        coords=_coords(history, chosen), name=series.name)


def tensor_dataarray(history, full_name: str, steps: Any = None) -> xr.DataArray:
    """Tensor ``full_name`` over ``steps`` as a lazy DataArray with dims ``(step, dim_0, ...)``.

    Args:
        history: the open run.
        full_name: the stored name (``History.resolve`` gives it).
        steps: None (every step holding the tensor), a slice of step values
            (the committed steps in it that hold the tensor), or a list of steps
            (each must hold it).

    Raises:
        ShapeChangeError: the tensor's shape or dtype differs between the steps,
            naming each step where it changes.
        KeyError: a listed step lacks the tensor.
    """
    explicit = steps is not None and not isinstance(steps, slice)
    chosen = select_steps(history, steps)
    per_step = _layout(history, chosen, full_name).get(full_name, {})
    missing = [s for s in chosen if s not in per_step]
    if missing and explicit:
        raise KeyError(f"tensor {full_name!r} is not in steps {missing} of {history.path}")
    chosen = [s for s in chosen if s in per_step]
    changes = _changes(per_step)
    if changes:
        raise ShapeChangeError(f"tensor {full_name!r} changes across steps in {history.path}: "
                               + "; ".join(changes) + ". Select steps of one shape.")
    if chosen:
        dtype, shape = per_step[chosen[0]]
    else:  # no step chosen: take the layout from any step, for an empty but well-typed array
        anywhere = history.store.index.tensor_stats(full_name)
        if not anywhere:
            raise KeyError(f"no tensor {full_name!r} in any step of {history.path}")
        rec = next(r for r in history.store.records(anywhere[0][0]) if r.name == full_name)
        dtype, shape = rec.dtype, tuple(rec.shape)
    dims = ("step", *(f"dim_{i}" for i in range(len(shape))))
    var = _variable(history, full_name, chosen, dtype, shape, dims)
    return xr.DataArray(var, coords=_coords(history, chosen), name=full_name)


def variable_name(full_name: str) -> str:
    """A name safe for xarray and netCDF: the stored name with ``/`` -> ``.`` (the group kept)."""
    return full_name.replace("/", ".")


def dimension_names(shape: tuple[int, ...]) -> tuple[str, ...]:
    """``dim{axis}_{length}`` for each axis: shared by tensors of that length on that axis."""
    return tuple(f"dim{i}_{n}" for i, n in enumerate(shape))


def _free(name: str, variables: dict) -> str:
    """``name``, or with ``_`` appended until no variable has it (two stored names mapped to one: both kept)."""
    while name in variables:
        name += "_"
    return name


def _scalar_variable(name: str, values: np.ndarray) -> xr.Variable:
    var = xr.Variable("step", values, attrs={"long_name": name})
    info = np.iinfo(np.int32)
    if values.dtype.kind in "iu" and values.size and not (info.min <= values.min() and values.max() <= info.max):
        var.encoding = {"dtype": "float64"}  # netCDF3 has no 64-bit integers (a token count, say)
    return var


def _check_names(history, patterns: list[str], scalars: list[str]) -> None:
    """Raise KeyError, as ``History.trace`` does, for each of ``patterns`` (names or globs)
    that selects no tensor of any step of ``history`` and no scalar: a typo gives an
    error, not a dataset without it."""
    tensors = history.names()
    chosen = selected(tensors, patterns)
    unmatched = [p for p in patterns if not chosen[p] and not any(_scalar_selected(n, [p]) for n in scalars)]
    if unmatched:
        hint = close_hint(unmatched[0], scalars + tensors)
        raise KeyError(f"no tensor or scalar of {history.path} matches {', '.join(map(repr, unmatched))}{hint}")


def _scalar_selected(name: str, patterns: list[str]) -> bool:
    """Whether one of ``patterns`` selects scalar ``name``: the name or a short form of it
    (``loss``; even one holding glob characters, ``acc[top1]``), or a glob of them."""
    return matches_scalar(name, patterns) or any(resolve_scalar(p, [name]) is not None for p in patterns)


def open_history_dataset(history, names: str | Iterable[str] | None = None,
                         steps: Any = None, drop_variables: Iterable[str] = ()) -> xr.Dataset:
    """Every tensor of ``history`` (matching ``names``) as a lazy variable over ``steps``,
    and every scalar as a variable over ``step`` (NaN at a step that lacks it).

    Tensors whose shape or dtype changes, or that some of the steps lack, are
    left out, listed in ``attrs["inconsistent_shapes"]`` / ``attrs["partial_tensors"]``
    (stored names, one per line: netCDF attributes hold no lists of strings) and warned
    about: one array over ``step`` cannot hold them faithfully. A name or glob of
    ``names`` that selects no tensor (of any step) and no scalar raises KeyError, as
    ``History.trace`` and ``History.to_xarray`` do; a step listed twice, ValueError.
    """
    from .history import name_list  # History imports this module when called, never at its own import

    patterns = None if names is None else name_list(names)
    drop = set(drop_variables)
    chosen = select_steps(history, steps)
    scalars = history.scalars()
    if patterns is not None:
        _check_names(history, patterns, list(scalars.columns))
    variables, inconsistent, partial, details = {}, [], [], []
    layout = _layout(history, chosen)
    wanted = None if patterns is None else selected_names(list(layout), patterns)
    for name, per_step in layout.items():
        safe = variable_name(name)
        if wanted is not None and name not in wanted or name in drop or safe in drop:
            continue
        changes = _changes(per_step)
        if changes:
            inconsistent.append(name)
            details.append(f"{name}: " + "; ".join(changes))
            continue
        if len(per_step) != len(chosen):
            partial.append(name)
            continue
        dtype, shape = next(iter(per_step.values()))
        variables[_free(safe, variables)] = _variable(history, name, chosen, dtype, shape, ("step", *dimension_names(shape)))
    for name, values in scalars.reindex(chosen).items():
        safe = variable_name(name)
        if patterns is not None and not _scalar_selected(name, patterns) or name in drop or safe in drop:
            continue
        variables[_free(safe, variables)] = _scalar_variable(name, values.to_numpy())
    if inconsistent:
        warnings.warn(f"{len(inconsistent)} tensors of {history.path} change shape or dtype across "
                      f"steps and are left out: " + " | ".join(details), stacklevel=4)
    if partial:
        warnings.warn(f"{len(partial)} tensors of {history.path} are missing from some of the steps "
                      f"and are left out: {', '.join(partial[:10])}", stacklevel=4)
    attrs = {"run": os.path.abspath(history.path), "inconsistent_shapes": "\n".join(inconsistent),
             "partial_tensors": "\n".join(partial)}
    return xr.Dataset(variables, coords=_coords(history, chosen), attrs=attrs)
