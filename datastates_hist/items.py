"""What a checkpoint is made of: named tensor items and plain-value items.

State Providers turn objects into these; the snapshot engine copies the
tensors; the backends store them; the index records them.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where tensors are made, not by readers of the index
    import torch

MAX_DIM = 2 ** 63 - 1  # numpy's dimensions are signed 64-bit


def too_big_for_numpy(shape, itemsize: int) -> str | None:
    """Why numpy cannot make an array of ``shape`` and ``itemsize``-byte elements, or None.
    numpy multiplies the itemsize by every nonzero dimension, and refuses a product past
    2**63-1 bytes even when another dimension is 0 (torch makes such an empty tensor)."""
    nbytes = itemsize
    for dim in shape:
        nbytes *= dim or 1
    if nbytes <= MAX_DIM:
        return None
    return (f"shape {list(shape)} of {itemsize}-byte elements: its nonzero dimensions span more than 2**63-1 "
            "bytes, more than an array can address")

# The model's tensors are stored under this prefix; readers let it be left out.
MODEL_PREFIX = "model/"


def under(name: str, prefix: str) -> bool:
    """Whether item ``name`` is ``prefix`` itself or lies below it (``prefix/...``)."""
    return name == prefix or name.startswith(prefix + "/")


def short_name(name: str) -> str:
    """A stored name without the :data:`MODEL_PREFIX` (as in ``model.state_dict()``)."""
    return name.removeprefix(MODEL_PREFIX)


def matches(name: str, patterns: list[str]) -> bool:
    """Whether a glob of ``patterns`` matches the stored name or its :func:`short_name`."""
    short = short_name(name)
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(short, p) for p in patterns)


def selected(names: list[str], patterns: list[str]) -> dict[str, list[str]]:
    """``{pattern: the names of names it selects}``: a pattern that is one of the names
    (stored, or its :func:`short_name`) selects that name alone, even where it holds glob
    characters (``a[0]`` is the tensor ``a[0]``, not ``a0``); any other is a glob."""
    by_name = {n: n for n in names} | {short_name(n): n for n in names if short_name(n) not in names}
    return {p: [by_name[p]] if p in by_name else [n for n in names if matches(n, [p])] for p in patterns}


def selected_names(names: list[str], patterns: list[str]) -> set[str]:
    """The names of ``names`` that any of ``patterns`` selects (:func:`selected`)."""
    return set().union(*selected(names, patterns).values())


@dataclass
class TensorItem:
    """One tensor to store under ``name``.

    Attributes:
        name: the item's full name, ``/``-separated (``model/blocks.0.attn.weight``).
        tensor: the live tensor; it is copied lazily, so it must not change before
            the snapshot completes (the hooks of the Checkpointer guard this).
        volatile: True for tensors that change during a forward pass (buffers
            such as BatchNorm statistics): they are copied first, and the next
            forward waits for them.
        global_shape / offset: when the tensor is a shard of a larger global
            tensor, its global shape and the offset of this shard in it.
        predictor: how the tensor follows from others of the same object
            (:mod:`.predictors`; names relative to the object), for its deltas.
        immutable: True when nothing changes the tensor until its checkpoint is
            committed (a tensor read from a file for an import): a host tensor is
            then written from its own memory, with no copy into the host cache.
    """

    name: str
    tensor: torch.Tensor
    volatile: bool = False
    global_shape: tuple[int, ...] | None = None
    offset: tuple[int, ...] | None = None
    predictor: dict | None = None
    immutable: bool = False


@dataclass
class ValueItem:
    """One plain value (already encoded as safe JSON data, see :mod:`values`)."""

    name: str
    value: Any


# How a tensor is stored (section 6 of docs/format.md): its bytes as they are,
# compressed alone, or compressed as the residual against its values at earlier steps.
RAW, KEY, DELTA = "raw", "key", "delta"
ENCODINGS = (RAW, KEY, DELTA)
PARTS = ("", "restore")
# the fields of a record (and of a manifest entry) of a tensor rounded to keep_bits
LOSSY_KEYS = ("keep_bits", "bound", "exact_checksum", "low_stored", "low_chunks")


@dataclass
class TensorRecord:
    """What the store records of one tensor of one step (a manifest entry, an index row)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: str = ""
    encoding: str = RAW  # RAW, KEY or DELTA (ENCODINGS)
    stats: dict[str, float] = field(default_factory=dict)
    global_shape: tuple[int, ...] | None = None  # set when the tensor is a shard
    offset: tuple[int, ...] | None = None
    # a tensor written by several ranks: where each part lies, as
    # {"start", "count", "checksum", "part"} (part: the rank whose file holds it, or None)
    blocks: list[dict] | None = None
    part: str = ""  # the unit of the step that holds it: "" the main one, "restore" the restore unit
    stored: int | None = None  # an encoded tensor: the bytes stored
    base: int | None = None  # a delta: the step it is encoded against
    base2: int | None = None  # a delta extrapolated from two steps: the base's own base
    chunks: list[list[int]] | None = None  # an encoded tensor: [[raw, stored, flag], ...] (codecs.py)
    update_ratio: float | None = None  # a delta of floats: ||x - base|| / ||base||
    # a delta predicted from other tensors (predictors.py) instead of its own earlier values
    predictor: dict | None = None
    # a tensor of floats: its values by sign and binary exponent (digest.distribution)
    distribution: dict | None = None
    # a lossy trajectory tensor (docs/format.md, section 6): its main unit holds the value
    # rounded to keep_bits mantissa bits (``checksum`` is of those bytes), relative error at
    # most ``bound``; while the step is a restore point, its restore unit holds the low bits
    # under the same name (``low_stored`` bytes in ``low_chunks``) and ``exact_checksum`` is
    # of the exact bytes, rounded XOR low
    keep_bits: int | None = None
    bound: float | None = None
    exact_checksum: str | None = None
    low_stored: int | None = None
    low_chunks: list[list[int]] | None = None

    def to_json(self) -> dict:
        doc = {
            "name": self.name, "dtype": self.dtype, "shape": list(self.shape),
            "nbytes": self.nbytes, "checksum": self.checksum,
            "encoding": self.encoding, "stats": self.stats,
        }
        if self.global_shape is not None:
            doc["global_shape"], doc["offset"] = list(self.global_shape), list(self.offset)
        if self.blocks is not None:
            doc["blocks"] = self.blocks
        for key in ("stored", "base", "base2", "predictor", "chunks", "update_ratio", "distribution",
                    *LOSSY_KEYS):
            if getattr(self, key) is not None:
                doc[key] = getattr(self, key)
        return doc

    @property
    def stored_bytes(self) -> int:
        """The bytes the tensor takes in its unit."""
        return self.nbytes if self.stored is None else self.stored

    @property
    def dropped_bits(self) -> int:
        """The mantissa bits rounding made zero (0 for an exact tensor): a delta's
        residual chunks may be stored shifted right by as many (codecs.SHIFTED)."""
        from .rounding import mantissa_bits

        bits = mantissa_bits(self.dtype)
        if bits is None or not _is_int(self.keep_bits) or not 0 < self.keep_bits <= bits:
            return 0  # exact, or a record its checks refuse
        return bits - self.keep_bits

    @property
    def base_steps(self) -> list[int]:
        """The steps a delta is decoded against: ``base``, then ``base2`` ([] for no delta)."""
        return [step for step in (self.base, self.base2) if step is not None]

    def dependencies(self, step: int) -> list[tuple[int, str]]:
        """The values ``(step, name)`` this tensor at ``step`` is decoded against: its own at
        its base steps, then for a predicted delta those its prediction reads (predictors.py)."""
        own = [(b, self.name) for b in self.base_steps]
        if self.predictor is None:
            return own
        from .predictors import dependencies

        return own + dependencies(self.predictor, step, self.base)

    @property
    def has_low_bits(self) -> bool:
        """Whether the exact value can be read: rounded, with its low bits in the restore unit."""
        return self.low_stored is not None

    @property
    def rounded_bits(self) -> int | None:
        """The mantissa bits kept where what a read gives is rounded: a tensor rounded to
        ``keep_bits`` whose low bits are gone (a trajectory point's); None where a read
        gives the exact value written: an exact tensor, or a rounded one of a restore point,
        whose restore unit keeps its low bits (docs/format.md, section 6)."""
        return None if self.keep_bits is None or self.has_low_bits else self.keep_bits

    @property
    def rounded_bound(self) -> float | None:
        """The relative error bound of what a read gives: :attr:`bound` where the read is
        rounded (:attr:`rounded_bits`), None where it is exact."""
        return None if self.rounded_bits is None else self.bound

    def without_low_bits(self) -> "TensorRecord":
        """The record as a trajectory point holds it: a lossy tensor's low bits (and the
        checksum of its exact bytes) are gone with the restore unit."""
        if self.keep_bits is not None:
            self.exact_checksum = self.low_stored = self.low_chunks = None
        return self

    @classmethod
    def from_json(cls, data: dict, indexed: bool = False) -> "TensorRecord":
        """The record of a manifest entry (or, ``indexed``, of an index row, which has no
        chunk table), checked (see :meth:`check`): a manifest may be damaged or crafted.
        Raises ValueError naming the tensor."""
        if not isinstance(data, dict):
            raise ValueError(f"a tensor entry is not a record: {str(data)[:80]!r}")
        try:
            rec = cls(
                name=data["name"], dtype=data["dtype"], shape=_tuple(data["shape"]),
                nbytes=data["nbytes"], checksum=data.get("checksum", ""),
                encoding=data.get("encoding", RAW), stats=dict(data.get("stats", {})),
                global_shape=_tuple(data["global_shape"]) if "global_shape" in data else None,
                offset=_tuple(data["offset"]) if "offset" in data else None,
                blocks=data["blocks"] if "blocks" in data else None,
                part=data.get("part") or "", stored=data.get("stored"), base=data.get("base"),
                base2=data.get("base2"), predictor=data.get("predictor"),
                chunks=data.get("chunks"), update_ratio=data.get("update_ratio"),
                distribution=data.get("distribution"),
                **{key: data.get(key) for key in LOSSY_KEYS},
            )
        except KeyError as exc:
            raise ValueError(f"the record of tensor {data.get('name')!r} has no {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the record of tensor {data.get('name')!r} is malformed: {exc}") from None
        rec.check(indexed)
        return rec

    def check(self, indexed: bool = False) -> None:
        """Raise ValueError naming the tensor unless its declared sizes agree:
        dimensions are integers from 0 to 2**63-1, shape x the stored dtype's
        itemsize is ``nbytes``, blocks lie inside the shape and hold every
        element once, and an encoded tensor's chunks hold its bytes. Checked
        before anything is allocated for the tensor."""
        name = self.name
        if not isinstance(name, str):
            raise ValueError(f"a tensor record is named {name!r}, not by a string")
        for what in ("shape", "global_shape", "offset"):
            dims = getattr(self, what)
            if (what == "shape" or dims is not None) and not _is_dims(dims):
                raise ValueError(f"tensor {name!r} has {what} {_shown(dims)}: each dimension must be an "
                                 "integer from 0 to 2**63-1")
        from .dtypes import storage_dtype, torch_dtype

        try:
            itemsize = storage_dtype(torch_dtype(self.dtype)).itemsize
        except TypeError:
            raise ValueError(f"tensor {name!r} has an unknown dtype {self.dtype!r}") from None
        for what in ("shape", "global_shape"):
            dims = getattr(self, what)
            why = None if dims is None else too_big_for_numpy(dims, itemsize)
            if why:
                raise ValueError(f"tensor {name!r} has the {why if what == 'shape' else 'global ' + why}")
        expected = math.prod(self.shape) * itemsize
        if not _is_int(self.nbytes) or self.nbytes != expected:
            raise ValueError(f"tensor {name!r} declares shape {list(self.shape)} of {self.dtype}, which is "
                             f"{expected} bytes, but records {self.nbytes!r} bytes")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"tensor {name!r} has the encoding {self.encoding!r}, which this version "
                             f"does not read (it reads {', '.join(ENCODINGS)})")
        if self.part not in PARTS:
            raise ValueError(f"tensor {name!r} lies in the unit {self.part!r}, not one of {list(PARTS)}")
        if any(getattr(self, key) is not None for key in LOSSY_KEYS):
            self._check_lossy(itemsize, indexed)  # first: how its chunks are read depends on it
        if self.encoding != RAW or self.predictor is not None:
            self._check_encoded(itemsize, indexed)
        if self.blocks is not None:
            self._check_blocks()
        if self.distribution is not None and not is_distribution(self.distribution):
            raise ValueError(f"tensor {name!r} has a malformed distribution: {str(self.distribution)[:200]}")
        check_statistics(name, self.stats, self.update_ratio)

    def _check_lossy(self, itemsize: int, indexed: bool) -> None:
        """A lossy tensor: kept bits its dtype has, the bound they give, an encoded main
        value; low bits (if any) with the exact checksum and, in a manifest, their chunks."""
        from .codecs import check_chunks
        from .rounding import check_keep_bits, rounding_bound

        name = self.name
        try:
            check_keep_bits(self.dtype, self.keep_bits)
        except ValueError as exc:
            raise ValueError(f"tensor {name!r} is rounded: {exc}") from None
        if self.bound != rounding_bound(self.dtype, self.keep_bits):
            raise ValueError(f"tensor {name!r} keeps {self.keep_bits} mantissa bits, whose bound is "
                             f"{rounding_bound(self.dtype, self.keep_bits)!r}, but records {self.bound!r}")
        if self.encoding == RAW:
            raise ValueError(f"tensor {name!r} is recorded as rounded, but stored raw: a writer rounds only "
                             "encoded tensors of the main unit")
        if self.part != "":
            raise ValueError(f"tensor {name!r} is rounded, but stored in the unit {self.part!r}: a writer "
                             "rounds only encoded tensors of the main unit")
        low = (self.exact_checksum, self.low_stored, self.low_chunks)
        if self.low_stored is None and self.exact_checksum is None and self.low_chunks is None:
            return
        if not (isinstance(self.exact_checksum, str) and self.exact_checksum and _is_int(self.low_stored)
                and self.low_stored >= 0 and (indexed or self.low_chunks is not None)):
            raise ValueError(f"tensor {name!r} is rounded with low bits {str(low)[:200]}: they need "
                             "exact_checksum, low_stored and (in a manifest) low_chunks")
        if not indexed:
            try:
                check_chunks(self.low_chunks, self.nbytes, self.low_stored, itemsize)
            except ValueError as exc:
                raise ValueError(f"tensor {name!r} (its low bits): {exc}") from None

    def _check_encoded(self, itemsize: int, indexed: bool) -> None:
        name = self.name
        if self.predictor is not None:
            from .predictors import DTYPES, check, dependencies

            try:
                check(self.predictor)
            except ValueError as exc:
                raise ValueError(f"tensor {name!r}: {exc}") from None
            others = sorted({n for _, n in dependencies(self.predictor, 1, 0)})
            if self.encoding != DELTA or self.base2 is not None or self.dtype not in DTYPES \
                    or name in others or self.dropped_bits:
                raise ValueError(f"tensor {name!r} is predicted from {', '.join(map(repr, others))} but is not an "
                                 f"exact {'/'.join(DTYPES)} delta against one base step of other tensors")
        if self.blocks is not None:
            raise ValueError(f"tensor {name!r} is encoded ({self.encoding}) and in blocks: a writer "
                             "encodes only whole tensors")
        if not _is_int(self.stored) or self.stored < 0:
            raise ValueError(f"tensor {name!r} is encoded but records {self.stored!r} stored bytes")
        if (self.encoding == DELTA) != _is_int(self.base) or (self.base is not None and self.base < 0):
            raise ValueError(f"tensor {name!r} has the encoding {self.encoding!r} and the base {self.base!r}: "
                             "a delta needs the step it is encoded against, a key none")
        if self.base2 is not None and not (self.base is not None and _is_int(self.base2) and 0 <= self.base2 < self.base):
            raise ValueError(f"tensor {name!r} has the bases {self.base!r} and {self.base2!r}: a second base "
                             "must be a step before the first")
        if not indexed:
            from .codecs import GROUP_KEYS, check_chunks

            try:
                check_chunks(self.chunks, self.nbytes, self.stored, itemsize,
                             shifts=self.encoding == DELTA and bool(self.dropped_bits),
                             groups=self.encoding == DELTA and self.dtype in GROUP_KEYS)
            except ValueError as exc:
                raise ValueError(f"tensor {name!r}: {exc}") from None

    def _check_blocks(self) -> None:
        if not isinstance(self.blocks, list):
            raise ValueError(f"tensor {self.name!r} has blocks {_shown(self.blocks)}, not a list")
        for b in self.blocks:
            ok = (isinstance(b, dict) and _is_dims(_tuple(b.get("start")))
                  and _is_dims(_tuple(b.get("count")))
                  and len(b["start"]) == len(self.shape) == len(b["count"])
                  and all(s + c <= n for s, c, n in zip(b["start"], b["count"], self.shape))
                  and (b.get("part") is None or _is_int(b["part"]))
                  and isinstance(b.get("checksum"), str) and b["checksum"])
            if not ok:
                raise ValueError(f"tensor {self.name!r} has a malformed block: {str(b)[:200]}")
        problem = tiling_problem(self.shape, self.blocks)
        if problem:
            raise ValueError(f"tensor {self.name!r} of shape {list(self.shape)}: {problem}")


def tiling_problem(shape: tuple[int, ...], blocks: list[dict]) -> str | None:
    """Why the boxes ``blocks`` (``{"start", "count"}``, inside ``shape``) do not hold
    every element of ``shape`` exactly once, or None when they tile it."""
    total = math.prod(shape)
    if len(shape) and len(blocks) > 1:
        import numpy as np  # here: readers of the index alone do not load it

        lo = np.array([b["start"] for b in blocks], dtype=object if total >= 2**62 else np.int64)
        hi = lo + np.array([b["count"] for b in blocks], dtype=lo.dtype)
        nonempty = np.all(hi > lo, axis=1)
        overlap = np.all((lo[:, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[:, None, :]), axis=2)
        overlap &= nonempty[:, None] & nonempty[None, :]
        np.fill_diagonal(overlap, False)
        if overlap.any():
            i, j = map(int, np.argwhere(overlap)[0])
            return f"its blocks at {blocks[i]['start']} and {blocks[j]['start']} overlap"
    held = sum(math.prod(b["count"]) for b in blocks)
    if total and held != total:
        return f"{held} of its {total} elements are in its blocks"
    return None


def _tuple(value):
    """A JSON list as a tuple; anything else as it is, for :meth:`TensorRecord.check` to name."""
    return tuple(value) if isinstance(value, list) else value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_statistics(name: str, stats: dict, update_ratio) -> None:
    """Raise ValueError naming tensor ``name`` unless its statistics are what the index
    stores in REAL columns (nonfinite: INTEGER): anything else is damage."""
    if not all(isinstance(k, str) and _is_stat(k, v) for k, v in stats.items()):
        raise ValueError(f"tensor {name!r} has malformed statistics: {str(stats)[:200]} (each is a "
                         "number or null; nonfinite a count)")
    if not (update_ratio is None or _is_real(update_ratio)):
        raise ValueError(f"tensor {name!r} has the update ratio {str(update_ratio)[:80]}, which is "
                         "not a number or null")


def _is_real(value) -> bool:
    """A float (NaN and infinities included: statistics of such data) or an int SQLite holds."""
    return isinstance(value, float) or (_is_int(value) and -2**63 <= value < 2**63)


def _is_stat(key: str, value) -> bool:
    if value is None:
        return True
    return _is_int(value) and 0 <= value < 2**63 if key == "nonfinite" else _is_real(value)


def is_distribution(d) -> bool:
    """``{"exp0", "zero", "negative", "positive"}`` as :func:`digest.distribution` makes it."""
    if not (isinstance(d, dict) and set(d) == {"exp0", "zero", "negative", "positive"}):
        return False
    negative, positive = d["negative"], d["positive"]
    # the normal exponents of float64, -1022..1023; counts of at most 2**63-1 values
    if not (_is_int(d["exp0"]) and isinstance(negative, list) and isinstance(positive, list)
            and len(negative) == len(positive) and -1022 <= d["exp0"] <= d["exp0"] + len(positive) <= 1024):
        return False
    counts = [d["zero"], *negative, *positive]
    # type() is int: not a bool, a float or an int subclass (a run's manifests hold
    # hundreds of these lists: map and set run in C)
    return set(map(type, counts)) == {int} and min(counts) >= 0 and max(counts) < 2**63


def _is_dims(dims) -> bool:
    return isinstance(dims, tuple) and all(_is_int(d) and 0 <= d <= MAX_DIM for d in dims)


def _shown(value) -> str:
    return repr(list(value)) if isinstance(value, tuple) else repr(value)
