"""The History API: read-only access to a run, for analysis and notebooks.

``dh.open(path)`` sees committed steps only, and is safe while a writer
appends or prunes. Statistics come from the index without reading tensor
data; ``read`` reads only the selection asked for; ``diff`` compares two
steps (of one run or of two runs) tensor by tensor.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from .dtypes import storage_torch_dtype
from .index import STAT_KEYS
from .items import MODEL_PREFIX, matches
from .store import StepData, Store


class History:
    """A run opened for reading. Use :func:`open`."""

    def __init__(self, path: str, max_open_steps: int = 8):
        self.path = str(path)
        self.store = Store(self.path)
        self._open: OrderedDict[int, StepData] = OrderedDict()
        self._max_open = max_open_steps

    # --- the index: no tensor data is read ------------------------------------------------

    @property
    def steps(self) -> list[int]:
        """Committed steps, ascending (new commits appear as they happen)."""
        return self.store.steps()

    def tensors(self, step: int):
        """A pandas DataFrame of the tensors of ``step``: name, shape, dtype, nbytes, statistics."""
        import pandas as pd

        rows = [{"name": r.name, "shape": tuple(r.shape), "dtype": r.dtype, "nbytes": r.nbytes,
                 **{k: r.stats.get(k, math.nan) for k in STAT_KEYS}}
                for r in self.store.records(step)]
        return pd.DataFrame(rows, columns=["name", "shape", "dtype", "nbytes", *STAT_KEYS])

    def names(self, step: int | None = None) -> list[str]:
        """Tensor names of ``step`` (default: of any step)."""
        if step is None:
            return self.store.index.tensor_names()
        return [r.name for r in self.store.records(step)]

    def resolve(self, name: str, step: int | None = None) -> str:
        """The stored name for ``name``; ``model/`` may be left out."""
        names = set(self.names(step))
        if name in names:
            return name
        if MODEL_PREFIX + name in names:
            return MODEL_PREFIX + name
        where = f"step {step}" if step is not None else "any step"
        close = [n for n in names if n.endswith(name)][:3]
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise KeyError(f"no tensor {name!r} in {where} of {self.path}{hint}")

    def stats(self, name: str):
        """Per-step statistics of one tensor from the index, as a DataFrame indexed by step."""
        import pandas as pd

        full = self.resolve(name)
        rows = self.store.index.tensor_stats(full)
        df = pd.DataFrame(rows, columns=["step", "time", *STAT_KEYS]).set_index("step")
        df.attrs["name"] = full
        return df

    # --- tensor data --------------------------------------------------------------------

    def step_data(self, step: int) -> StepData:
        """The open data of ``step`` (a few are kept open)."""
        if step in self._open:
            self._open.move_to_end(step)
            return self._open[step]
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
        """A lazily loaded ``xarray.DataArray`` of one tensor over steps (dims ``step, dim_0, ...``)."""
        from .xarray_views import tensor_dataarray

        return tensor_dataarray(self, self.resolve(name), steps)

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


def _compared(name: str, patterns: list[str] | None) -> bool:
    if patterns is None:  # RNG states change every step and say nothing about the model
        return not name.startswith("rng/")
    return matches(name, patterns)


def diff_steps(ha: History, a: int, hb: History, b: int, names=None):
    """Per tensor present in both steps: l2 of the difference, relative l2, max abs
    difference, cosine similarity, and the fraction of elements that changed."""
    import pandas as pd

    patterns = [names] if isinstance(names, str) else names
    ra = {r.name: r for r in ha.store.records(a)}
    rb = {r.name: r for r in hb.store.records(b)}
    rows = []
    for name in [n for n in ra if n in rb and _compared(n, patterns)]:
        if ra[name].shape != rb[name].shape:
            rows.append({"name": name, "shape": ra[name].shape, "note": f"shape {list(ra[name].shape)} -> {list(rb[name].shape)}"})
            continue
        x = ha.step_data(a).read(name)
        y = hb.step_data(b).read(name)
        rows.append({"name": name, "shape": tuple(ra[name].shape), **compare(x, y), "note": ""})
    if patterns is not None and not rows:
        raise KeyError(f"no tensor matches {', '.join(patterns)} in both steps")
    cols = ["name", "shape", "l2", "rel_l2", "max_abs", "cosine", "frac_changed", "note"]
    return pd.DataFrame(rows, columns=cols)


def compare(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Difference metrics of two tensors of the same shape, computed in float64.

    A position holding NaN in both tensors counts as unchanged and is left out of
    every metric; a position equal in both (equal infinities too) has difference 0.
    So two identical steps compare as unchanged (``l2``, ``rel_l2``, ``max_abs`` and
    ``frac_changed`` 0) whatever they hold. NaN against a number is a change, and
    makes ``l2``, ``rel_l2``, ``max_abs`` and ``cosine`` NaN.
    """
    numel = x.numel()
    parts = x.is_complex()  # compared as (real, imaginary) pairs
    if parts:
        x, y = torch.view_as_real(x), torch.view_as_real(y)
    both_nan = torch.isnan(x) & torch.isnan(y)
    same = (x == y) | both_nan  # in the stored dtype: float64 would merge large int64s
    changed = float((~(same.all(-1) if parts else same)).sum()) / numel if numel else 0.0
    kept = ~both_nan
    xd, yd = x[kept].to(torch.float64), y[kept].to(torch.float64)
    d = torch.where(same[kept], 0.0, yd - xd)  # equal infinities differ by 0, not NaN
    l2 = float(torch.linalg.vector_norm(d)) if d.numel() else 0.0
    nx = float(torch.linalg.vector_norm(xd)) if xd.numel() else 0.0
    ny = float(torch.linalg.vector_norm(yd)) if yd.numel() else 0.0
    return {
        "l2": l2,
        "rel_l2": 0.0 if l2 == 0 else (l2 / nx if nx else math.inf),
        "max_abs": float(d.abs().max()) if d.numel() else 0.0,
        "cosine": float(torch.dot(xd, yd)) / (nx * ny) if nx and ny else math.nan,
        "frac_changed": changed,
    }
