"""The History API: read-only access to a run, for analysis and notebooks.

``dh.open(path)`` sees committed steps only, and is safe while a writer
appends or prunes. Statistics, distributions and scalars (the loss, the
learning rates: the numbers written with each step) come from the index
without reading tensor data; ``read`` reads only the selection asked for; ``diff`` compares two
steps (of one run or of two runs) tensor by tensor.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from .dtypes import storage_torch_dtype
from .errors import StepNotFoundError
from .index import STAT_KEYS, TENSOR_STATS
from .items import MODEL_PREFIX, matches, selected_names
from .layout import asked_step, count_of, run_path
from .scalars import close_hint, matches_scalar, resolve_scalar, scalars_of
from .step_data import StepData
from .store import Store


class History:
    """A run opened for reading. Use :func:`open`."""

    def __init__(self, path: str, max_open_steps: int = 8):
        self.path = run_path(path)
        # the step just opened is the one read: at least it stays open
        self._max_open = count_of(max_open_steps, "max_open_steps")
        self.store = Store(self.path)
        self._open: OrderedDict[int, StepData] = OrderedDict()

    # --- the index: no tensor data is read ------------------------------------------------

    @property
    def steps(self) -> list[int]:
        """Committed steps, ascending (new commits appear as they happen)."""
        return self.store.steps()

    @property
    def restore_points(self) -> list[int]:
        """The steps that restore the whole state (the others are trajectory points)."""
        return self.store.restore_points()

    def tensors(self, step: int):
        """A pandas DataFrame of the tensors of ``step``: name, shape, dtype, nbytes, statistics,
        and how each is stored (encoding, stored bytes, the update ratio of a delta; for a
        tensor rounded to ``keep_bits`` in a trajectory point, the bits kept and the relative
        error bound, NaN for a tensor that reads exact: a restore point's rounded tensors read
        exact, with their low bits; see :attr:`.items.TensorRecord.rounded_bits`). The statistics are of the exact values."""
        import pandas as pd

        columns = ["name", "shape", "dtype", "nbytes", *STAT_KEYS, "encoding", "stored", "update_ratio",
                   "keep_bits", "bound"]
        rows = [{"name": r.name, "shape": tuple(r.shape), "dtype": r.dtype, "nbytes": r.nbytes,
                 **{k: r.stats.get(k, math.nan) for k in STAT_KEYS}, "encoding": r.encoding,
                 "stored": r.stored_bytes + (r.low_stored or 0),
                 "update_ratio": math.nan if r.update_ratio is None else r.update_ratio,
                 "keep_bits": math.nan if r.rounded_bits is None else r.rounded_bits,
                 "bound": math.nan if r.rounded_bound is None else r.rounded_bound}
                for r in self.store.records(step)]
        return pd.DataFrame(rows, columns=columns)

    def names(self, step: int | None = None) -> list[str]:
        """Tensor names of ``step`` (default: of any step)."""
        if step is None:
            return self.store.index.tensor_names()
        return [r.name for r in self.store.records(step)]

    def resolve(self, name: str, step: int | None = None) -> str:
        """The stored name for ``name``; ``model/`` may be left out."""
        if not isinstance(name, str):
            raise TypeError(f"a tensor name is a str, got {name!r}")
        names = set(self.names(step))
        if name in names:
            return name
        if MODEL_PREFIX + name in names:
            return MODEL_PREFIX + name
        where = f"step {step}" if step is not None else "any step"
        row = self.store.index.step_row(step) if step is not None else None
        if row is not None and row.tier == "trajectory":
            kept = set(self.names())
            if name in kept or MODEL_PREFIX + name in kept:  # a restore point's tensor: let go of here
                points = self.store.restore_points()
                near = min(points, key=lambda p: abs(p - step), default=None)
                raise KeyError(f"no tensor {name!r} in step {step} of {self.path}: it is a trajectory point, which "
                               "keeps only the trajectory's tensors" +
                               (f"; the nearest restore point is step {near}" if near is not None else ""))
        raise KeyError(f"no tensor {name!r} in {where} of {self.path}{close_hint(name, sorted(names))}")

    def stats(self, name: str):
        """Per-step statistics of one tensor from the index, as a DataFrame indexed by step;
        ``update_ratio`` is ||x - x_base|| / ||x_base|| where the step stores a delta against
        ``x_base`` (the step before, when every step is kept), NaN elsewhere. For a tensor
        rounded to ``keep_bits`` (``Trajectory(keep_bits=...)``), norm, min, max and the other
        statistics are those of its exact values, as written; the update ratio is that of
        its rounded values, as stored."""
        import pandas as pd

        full = self.resolve(name)
        rows = self.store.index.tensor_stats(full)
        df = pd.DataFrame(rows, columns=["step", "time", *TENSOR_STATS]).set_index("step")
        df.attrs["name"] = full
        return df

    def histogram(self, name: str):
        """How the values of one tensor of floats are distributed at every step, from the
        index: a DataFrame indexed by step, one column per bin, holding counts.

        Bins are by sign and binary exponent: column ``2.0**e`` counts the values in
        ``[2**e, 2**(e+1))``, column ``-2.0**e`` those in ``(-2**(e+1), -2**e]``, column
        ``0.0`` the zeros, with the subnormal values of float32, bfloat16 and float64
        (a float16 or float8 value is binned by its exponent, subnormal or not);
        columns run from the most negative bin to the most positive. NaN and
        infinities are in no bin (see
        :meth:`stats`, ``nonfinite``). A step written before distributions were
        recorded has no row.
        """
        import pandas as pd

        full = self.resolve(name)
        rows = {}
        for step, d in self.store.index.distributions(full):
            row = {-(2.0 ** (d["exp0"] + i)): n for i, n in enumerate(d["negative"]) if n}
            row[0.0] = d["zero"]
            row.update({2.0 ** (d["exp0"] + i): n for i, n in enumerate(d["positive"]) if n})
            rows[step] = row
        df = pd.DataFrame.from_dict(rows, orient="index").fillna(0).astype("int64")
        df = df.reindex(columns=_bins(df.columns), fill_value=0).rename_axis("step")
        df.attrs["name"] = full
        return df

    # --- scalars: the plain numbers written with each step (scalars.py names them) ------

    def _scalar_rows(self) -> list[tuple[int, str, float]]:
        """``(step, name, value)`` of every scalar of every committed step, by step.

        From the index; a step committed before the index recorded scalars (by an
        earlier version) has them read from its manifest.
        """
        index = self.store.index
        rows = [(s, n, math.nan if v is None else v) for s, n, v in index.scalar_rows()]
        start, recorded = index.scalars_from(), set(index.scalar_steps())
        for step in self.steps:
            if step in recorded or (start is not None and step >= start):
                continue
            try:
                with self.store.open_step(step) as data:
                    items = data.values["items"]
            except StepNotFoundError:  # pruned by a writer meanwhile
                continue
            rows.extend((step, name, value) for name, value in scalars_of(items).items())
        rows.sort(key=lambda r: r[0])
        return rows

    def scalar_names(self) -> list[str]:
        """The names of the scalars of any step, sorted."""
        return sorted({name for _, name, _ in self._scalar_rows()})

    def scalars(self, names: str | list[str] | None = None):
        """A pandas DataFrame of scalars: index ``step``, one column per scalar name.

        ``names``: names, short forms (``loss`` for ``extra/data/loss``) or globs
        (default: every scalar). A step that lacks a scalar holds NaN there.
        """
        return self._scalar_frame(self._scalar_rows(), names)

    def scalar(self, name: str):
        """One scalar over the steps that hold it, as a pandas Series indexed by step."""
        if not isinstance(name, str):
            raise TypeError(f"a scalar name is a str, got {name!r}")
        rows = self._scalar_rows()
        full = self._resolve_scalar(name, rows)
        import pandas as pd

        steps, values = zip(*[(s, v) for s, n, v in rows if n == full])
        return pd.Series(values, index=pd.Index(steps, name="step"), name=full)

    def trace(self, names: str | list[str], stat: str = "norm"):
        """Scalars and one statistic of tensors side by side: a DataFrame indexed by step,
        one column per stored name, over the steps any of them has (NaN elsewhere).

        ``names``: tensor names (``model/`` may be left out), scalar names or short
        forms (``loss``), or globs of either (``blocks.0.*``). An unknown name raises
        ``KeyError`` naming it and the names closest to it. ``stat``: a statistic
        of :meth:`stats` (norm, min, max, mean, std, nonfinite, update_ratio);
        ``update_ratio`` is NaN at the steps that store a tensor as a key or raw.
        """
        import pandas as pd

        known = TENSOR_STATS
        if stat not in known:
            raise ValueError(f"unknown statistic {stat!r}; one of {', '.join(known)}")
        wanted = name_list(names)
        tensors = self.names()
        rows: list | None = None  # the scalars, read once and only if needed
        columns: dict[str, pd.Series] = {}
        for name in wanted:
            exact = [t for t in (name, MODEL_PREFIX + name) if t in tensors][:1]
            glob = any(c in name for c in "*?[") and not exact  # a name holding '[' is itself first
            found_tensors = [t for t in tensors if matches(t, [name])] if glob else exact
            for t in found_tensors:
                columns.setdefault(t, self.stats(t)[stat].rename(t))
            if found_tensors and not glob:
                continue
            rows = self._scalar_rows() if rows is None else rows
            known = sorted({n for _, n, _ in rows})
            full = resolve_scalar(name, known)
            found_scalars = ([full] if full else [n for n in known if matches_scalar(n, [name])] if glob
                             else [])
            if not found_tensors and not found_scalars:
                hint = close_hint(name, known + tensors)
                raise KeyError(f"no tensor matches {name!r} in {self.path}, nor a scalar{hint}" if glob
                               else f"no tensor {name!r} in {self.path}, nor a scalar{hint}")
            frame = self._scalar_frame(rows, found_scalars)
            for n in found_scalars:
                columns.setdefault(n, frame[n])
        out = pd.DataFrame(columns)
        out.index.name = "step"
        out.attrs["tensors"] = [n for n in columns if n in tensors]  # the others are scalars
        return out.sort_index()

    def _resolve_scalar(self, name: str, rows: list[tuple]) -> str:
        known = sorted({n for _, n, _ in rows})
        full = resolve_scalar(name, known)
        if full is None:
            raise KeyError(f"no scalar {name!r} in {self.path}{close_hint(name, known)}")
        return full

    def _scalar_frame(self, rows: list[tuple], names: str | list[str] | None):
        import pandas as pd

        known = sorted({n for _, n, _ in rows})
        if names is None:
            chosen = known
        else:
            chosen = []
            for name in name_list(names):
                if any(c in name for c in "*?[") and resolve_scalar(name, known) is None:
                    picked = [n for n in known if matches_scalar(n, [name])]
                    if not picked:
                        raise KeyError(f"no scalar matches {name!r} in {self.path}")
                else:
                    picked = [self._resolve_scalar(name, rows)]
                chosen += [n for n in picked if n not in chosen]
        wanted = set(chosen)
        table: dict[str, dict[int, float]] = {n: {} for n in chosen}
        for step, name, value in rows:
            if name in wanted:
                table[name][step] = value
        out = pd.DataFrame(table, columns=chosen)
        out.index.name = "step"
        return out.sort_index()

    # --- tensor data --------------------------------------------------------------------

    def step_data(self, step: int) -> StepData:
        """The open data of ``step`` (a few are kept open)."""
        step = asked_step(step)
        data = self._open.get(step)
        if data is not None and self.store.index.step_row(step) == data.row:
            self._open.move_to_end(step)
            return data
        if data is not None:  # truncated and written again since it was opened
            self._open.pop(step).close()
        data = self.store.open_step(step)
        self._open[step] = data
        while len(self._open) > self._max_open:
            self._open.popitem(last=False)[1].close()
        return data

    def read(self, name: str, step: int, index: Any = None) -> torch.Tensor:
        """Tensor ``name`` at ``step``, or only ``index`` of it (ints and slices, numpy-style).

        A whole tensor is checked against its checksum; a selection reads only
        the bytes it needs, without that check.
        """
        data = self.step_data(step)
        full = name if name in data.records else self.resolve(name, step)
        if index is None:
            return data.read(full)
        shape = data.records[full].shape
        start, count, post = selection(index, shape)
        box = data.read_box(full, start, count)
        # numpy applies negative strides, which torch cannot; same-width integer view keeps bits
        raw = np.array(box.view(storage_torch_dtype(box.dtype)).numpy()[post], copy=True)
        return torch.from_numpy(raw).view(box.dtype)

    def diff(self, a: int, b: int, names: str | list[str] | None = None, other: "History | None" = None):
        """Compare step ``a`` with step ``b`` (of ``other`` when given), tensor by tensor."""
        return diff_steps(self, a, other or self, b, names)

    def to_xarray(self, name: str, steps: Any = None):
        """A lazily loaded ``xarray.DataArray`` of one tensor over steps (dims ``step, dim_0, ...``),
        or of one scalar (dim ``step``) when ``name`` is no tensor."""
        from .xarray_views import scalar_dataarray, tensor_dataarray

        try:
            full = self.resolve(name)
        except KeyError as not_tensor:
            try:
                return scalar_dataarray(self, self.scalar(name), steps)
            except KeyError:
                raise not_tensor from None
        return tensor_dataarray(self, full, steps)

    def close(self) -> None:
        for data in self._open.values():
            data.close()
        self._open.clear()
        self.store.close()

    def __enter__(self) -> "History":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open(path) -> History:  # noqa: A001 (the public name is dh.open)
    """Open the run at ``path`` for reading."""
    return History(path)


def _bins(found) -> list[float]:
    """Every bin from the lowest to the highest exponent ``found`` on each side of zero,
    with zero: bins no step uses inside that span stay, so that columns are evenly spaced."""
    bins = [0.0]
    for sign in (-1.0, 1.0):
        exponents = [math.frexp(abs(b))[1] - 1 for b in found if b * sign > 0]
        if exponents:
            bins += [sign * 2.0 ** e for e in range(min(exponents), max(exponents) + 1)]
    return sorted(bins)


def selection(index: Any, shape: tuple[int, ...]) -> tuple[tuple, tuple, tuple]:
    """Turn a numpy-style ``index`` into the box to read and the index to apply to the box."""
    if not isinstance(index, tuple):
        index = (index,)
    if any(i is Ellipsis for i in index):
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - len(index) + 1) + index[at + 1:]
    if len(index) > len(shape):
        raise IndexError(f"too many indices ({len(index)}) for a tensor of shape {list(shape)}")
    index = index + (slice(None),) * (len(shape) - len(index))
    start, count, post = [], [], []
    for i, n in zip(index, shape):
        if isinstance(i, (bool, np.bool_)):  # numpy takes True as a new axis, torch as a mask: neither is read
            raise TypeError(f"unsupported index {i!r}: a bool is no position; use ints, slices and ...")
        if isinstance(i, slice):
            lo, hi, stride = i.indices(n)
            picked = range(lo, hi, stride)
            if len(picked) == 0:
                start.append(0), count.append(0), post.append(slice(None))
                continue
            first, last = min(picked[0], picked[-1]), max(picked[0], picked[-1])
            start.append(first), count.append(last - first + 1)
            post.append(slice(picked[0] - first, None if stride < 0 and picked[-1] == first
                              else picked[-1] - first + (1 if stride > 0 else -1), stride))
        elif isinstance(i, (int, np.integer)):
            j = int(i) + n if i < 0 else int(i)
            if not 0 <= j < n:
                raise IndexError(f"index {i} is out of bounds for a dimension of size {n}")
            start.append(j), count.append(1), post.append(0)
        else:
            raise TypeError(f"unsupported index {i!r}: use ints, slices and ...")
    return tuple(start), tuple(count), tuple(post)


def name_list(names: Any, what: str = "names") -> list[str]:
    """``names`` (a name or glob, or an iterable of them) as a list of str, else a
    TypeError that says what was given."""
    listed = [names] if isinstance(names, str) else None
    if listed is None:
        try:
            listed = list(names)
        except TypeError:
            raise TypeError(f"{what}: a name, a glob or a list of them, got {names!r}") from None
    for name in listed:
        if not isinstance(name, str):
            raise TypeError(f"{what}: a name is a str, got {name!r}")
    return listed


def compared(name: str, chosen: set[str] | None) -> bool:
    """Whether a diff compares tensor ``name`` (the tensors ``--names`` chose, or None)."""
    if chosen is None:  # RNG states change every step and say nothing about the model
        return not name.startswith("rng/")
    return name in chosen


def diff_steps(ha: History, a: int, hb: History, b: int, names=None):
    """Per tensor present in both steps: l2 of the difference, relative l2, max abs
    difference, cosine similarity, the fraction of elements that changed, and
    whether it holds whole numbers only (``integral``: counters, masks); a tensor
    whose shape changed is not compared (``note`` says so, ``shape_b`` is its shape at b)."""
    import pandas as pd

    patterns = None if names is None else name_list(names)
    ra = {r.name: r for r in ha.store.records(a)}
    rb = {r.name: r for r in hb.store.records(b)}
    rows = []
    both = [n for n in ra if n in rb]
    # a name that one step alone holds is still a name
    chosen = None if patterns is None else selected_names(list(dict.fromkeys([*ra, *rb])), patterns)
    for name in [n for n in both if compared(n, chosen)]:
        if ra[name].shape != rb[name].shape:
            rows.append({"name": name, "shape": ra[name].shape, "integral": False,  # not compared
                         "note": f"shape {list(ra[name].shape)} -> {list(rb[name].shape)}",
                         "shape_b": tuple(rb[name].shape)})
            continue
        x = ha.step_data(a).read(name)
        y = hb.step_data(b).read(name)
        rows.append({"name": name, "shape": tuple(ra[name].shape), **compare(x, y), "note": "", "shape_b": None})
    if patterns is not None and not rows:
        raise KeyError(f"no tensor matches {', '.join(patterns)} in both steps")
    cols = ["name", "shape", "l2", "rel_l2", "max_abs", "cosine", "frac_changed", "integral", "note", "shape_b"]
    return pd.DataFrame(rows, columns=cols)


COMPARE_CHUNK = 1 << 20  # elements compared at a time


def compare(x: torch.Tensor, y: torch.Tensor) -> dict[str, float | bool]:
    """Difference metrics of two tensors of the same shape, computed in float64.

    A position holding NaN in both tensors counts as unchanged and is left out of
    every metric; a position equal in both (equal infinities too) has difference 0.
    So two identical steps compare as unchanged (``l2``, ``rel_l2``, ``max_abs`` and
    ``frac_changed`` 0) whatever they hold. NaN against a number is a change, and
    makes ``l2``, ``rel_l2``, ``max_abs`` and ``cosine`` NaN. ``rel_l2`` is ``l2``
    over the norm of ``x``, NaN when that norm is 0 and the tensor changed.
    ``integral``: both tensors hold whole numbers only (an optimizer's float ``step``
    counter, an integer buffer, a mask), which rankings of change leave out.
    """
    numel = x.numel()
    if x.is_floating_point() and x.element_size() == 1:  # float8: torch has few kernels for it
        x, y = x.float(), y.float()  # exact, NaN and infinities kept
    parts = x.is_complex()  # compared as (real, imaginary) pairs
    if parts:
        x, y = torch.view_as_real(x), torch.view_as_real(y)
    # element by element in chunks: the float64 copies and masks of a whole tensor took
    # about 10 times its size (a 1 GB embedding: some 10 GB)
    x, y = (x.reshape(-1, 2), y.reshape(-1, 2)) if parts else (x.reshape(-1), y.reshape(-1))
    n_changed, d_sq, x_sq, y_sq, xy, max_abs = 0, 0.0, 0.0, 0.0, 0.0, 0.0
    for i in range(0, x.shape[0], COMPARE_CHUNK):
        xc, yc = x[i:i + COMPARE_CHUNK], y[i:i + COMPARE_CHUNK]
        both_nan = torch.isnan(xc) & torch.isnan(yc)
        same = (xc == yc) | both_nan  # in the stored dtype: float64 would merge large int64s
        n_changed += int((~(same.all(-1) if parts else same)).sum())
        kept = ~both_nan
        xd, yd = xc[kept].to(torch.float64), yc[kept].to(torch.float64)
        if not xd.numel():
            continue
        d = torch.where(same[kept], 0.0, yd - xd)  # equal infinities differ by 0, not NaN
        d_sq += float(torch.dot(d, d))
        x_sq += float(torch.dot(xd, xd))
        y_sq += float(torch.dot(yd, yd))
        xy += float(torch.dot(xd, yd))
        top = float(d.abs().max())
        if math.isnan(top) or top > max_abs:  # NaN stays
            max_abs = top
    changed = n_changed / numel if numel else 0.0
    l2, nx, ny = math.sqrt(d_sq), math.sqrt(x_sq), math.sqrt(y_sq)
    return {
        "l2": l2,
        # A change relative to an all-zero tensor has no value: NaN, which a ranking puts
        # last, where inf put every zero-initialised tensor first. No floor (l2 / max(nx,
        # eps)) is used: any eps would be a scale the tensor does not have, and give a
        # number that looks like a measurement.
        "rel_l2": 0.0 if l2 == 0 else (l2 / nx if nx else math.nan),
        "max_abs": max_abs,
        "cosine": xy / (nx * ny) if nx and ny else math.nan,
        "frac_changed": changed,
        "integral": whole(x) and whole(y),
    }


def whole(x: torch.Tensor) -> bool:
    """Whether every element of ``x`` is a whole number (any integer dtype)."""
    if not (x.is_floating_point() or x.is_complex()):
        return True
    x = x.reshape(-1)
    return all(bool(torch.isfinite(c).all() and (c == c.trunc()).all()) for c in x.split(COMPARE_CHUNK))
