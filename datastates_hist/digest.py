"""Checksums and statistics of tensors, computed piece by piece during the flush.

The checksum is xxh3-64 of the stored bytes in C order (xxhash releases the GIL).
Statistics (L2 norm, min, max, mean, population std, count of non-finite values)
are computed in chunks that fit the CPU cache and combined with Chan's parallel
formula, so a tensor streamed through the host cache gets the same figures as
one read whole. The distribution of a floating-point tensor is counted with them:
its values by sign and binary exponent (:func:`distribution`), exact, and cheap
enough to keep for every step. The C kernel ``_fused`` (float64 accumulators, one pass over
memory that also makes the snapshot's copy) does a chunk when it is built;
numpy otherwise.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch
import xxhash

try:  # the C kernel (setup.py): copy and statistics in one pass over memory
    from . import _fused
except ImportError:  # built without a C compiler: numpy computes the same, in more passes
    _fused = None

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
# Elements per statistics pass: small enough that the deviation pass runs in
# cache, so a piece costs about one pass over memory (2x faster than 4M chunks).
CHUNK = 1 << 16


def as_float(raw: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Values of a piece as float32/float64 (complex: magnitudes), from its stored bytes."""
    if dtype in (torch.float32, torch.float64):
        return raw
    if dtype == torch.bfloat16:  # the upper half of a float32
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if dtype == torch.float16:
        return raw.view(np.float16).astype(np.float32)
    if dtype.is_complex:
        return np.abs(raw)
    if dtype.is_floating_point:  # float8: no numpy type
        return torch.from_numpy(raw).view(dtype).to(torch.float32).numpy()
    return raw.astype(np.float64)  # integers and bool


def checksum_bytes(data) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def checksum_stream():
    """The checksum of bytes given piece by piece (``update``, then ``hexdigest``): the
    same digest as :func:`checksum_bytes` of them all."""
    return xxhash.xxh3_64()


def merge_moments(a: tuple[int, float, float], b: tuple[int, float, float]) -> tuple[int, float, float]:
    """``(count, mean, m2)`` of two parts together, from each part's count, mean and
    sum of squared deviations from its mean ``m2`` (Chan's parallel formula)."""
    n_a, mean_a, m2_a = a
    n_b, mean_b, m2_b = b
    total = n_a + n_b
    delta = mean_b - mean_a
    return total, mean_a + delta * n_b / total, m2_a + (m2_b + delta * delta * n_a * n_b / total)


# biased exponent bits of float32 and float64: the counts' layout (see _fused.c)
_EXPONENT_BITS = {4: 8, 8: 11}


def _count_exponents(x: np.ndarray, counts: np.ndarray) -> None:
    """Add the values of float32/float64 ``x`` to ``counts`` by sign and biased exponent,
    ``counts[sign * NB + exponent]``: the top bits of each value, as the C kernel does."""
    bits = x.view(np.uint32 if x.itemsize == 4 else np.uint64)
    top = bits >> bits.dtype.type(8 * x.itemsize - 1 - _EXPONENT_BITS[x.itemsize])
    counts += np.bincount(top.astype(np.intp), minlength=counts.size)


def distribution(counts: np.ndarray) -> dict:
    """The stored form of exponent ``counts``: ``{"exp0", "zero", "negative", "positive"}``,
    where ``positive[i]`` counts the values in ``[2**(exp0+i), 2**(exp0+i+1))``,
    ``negative[i]`` those in ``(-2**(exp0+i+1), -2**(exp0+i)]``, and ``zero`` those of
    magnitude below the smallest normal number (``2**-126`` for float32, ``2**-1022``
    for float64): zeros and subnormals. NaN and infinities are not counted
    (``nonfinite`` counts them). The counts' size tells their layout, float32's or float64's."""
    nb = counts.size // 2
    bias = nb // 2 - 1
    signs = counts.reshape(2, nb)[:, 1:nb - 1]  # exponent 0: zero and subnormal; the last: inf, NaN
    zero = int(counts[0] + counts[nb])
    used = np.flatnonzero(signs[0] | signs[1])  # counts are >= 0; one call per tensor fewer than any()
    if used.size == 0:
        return {"exp0": 0, "zero": zero, "negative": [], "positive": []}
    lo, hi = int(used[0]), int(used[-1]) + 1
    positive, negative = signs[:, lo:hi].tolist()
    return {"exp0": lo + 1 - bias, "zero": zero, "negative": negative, "positive": positive}


def combine_distributions(parts: list[dict]) -> dict:
    """The distribution of a tensor from those of its blocks (:func:`distribution`)."""
    spans = [(d["exp0"], d["exp0"] + len(d["positive"])) for d in parts if d["positive"]]
    lo = min((a for a, _ in spans), default=0)
    width = max((b for _, b in spans), default=0) - lo
    negative, positive = [0] * width, [0] * width
    for d in parts:
        for i, (neg, pos) in enumerate(zip(d["negative"], d["positive"]), d["exp0"] - lo):
            negative[i] += neg
            positive[i] += pos
    return {"exp0": lo, "zero": sum(d["zero"] for d in parts), "negative": negative, "positive": positive}


class Digest:
    """Running checksum, statistics and distribution of one tensor."""

    def __init__(self) -> None:
        self.hasher = checksum_stream()
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.sum = 0.0  # plain: the mean of a tensor holding infinities or NaN
        self.min = math.inf
        self.max = -math.inf
        self.nonfinite = 0
        self.counts: np.ndarray | None = None  # by sign and exponent, of floating-point values

    def update(self, raw: np.ndarray, dtype: torch.dtype) -> None:
        """Add a piece: ``raw`` its stored bytes (the storage dtype), ``dtype`` the real one.

        The C kernel or numpy, not torch, does the arithmetic: it runs on this thread
        alone, where torch would start an OpenMP team that competes with training's.
        """
        flat = raw.reshape(-1)
        for i in range(0, flat.size, CHUNK):
            self._add_chunk(flat[i:i + CHUNK], dtype)

    def copy_update(self, dst: np.ndarray, src: np.ndarray, dtype: torch.dtype) -> None:
        """Copy ``src`` into ``dst`` (same shape, storage dtype) and add it, chunk by
        chunk: each chunk is hashed and summarised while it is still in the CPU cache,
        so the piece crosses memory once instead of three times."""
        if not (dst.flags.c_contiguous and src.flags.c_contiguous):
            np.copyto(dst, src)
            self.update(dst, dtype)
            return
        out, flat = dst.reshape(-1), src.reshape(-1)
        fused = _fused is not None and flat.dtype in _FLOATS  # stored as itself: float32/64
        for i in range(0, flat.size, CHUNK):
            chunk = out[i:i + CHUNK]
            if fused:
                self._merge(chunk.size, *_fused.copy_stats(flat[i:i + CHUNK], chunk, chunk.itemsize,
                                                           self._counts(chunk.itemsize)))
                self.hasher.update(chunk.view(np.uint8))
            else:
                np.copyto(chunk, flat[i:i + CHUNK])
                self._add_chunk(chunk, dtype)

    def _add_chunk(self, chunk: np.ndarray, dtype: torch.dtype) -> None:
        self.hasher.update(chunk.view(np.uint8))  # xxh3 streams: chunk by chunk is the same digest
        values = as_float(chunk, dtype)
        self._add(values, self._counts(values.itemsize) if dtype.is_floating_point else None)

    def _counts(self, itemsize: int) -> np.ndarray:
        """The tensor's counts by sign and exponent, in the layout of ``itemsize`` values."""
        if self.counts is None:
            self.counts = np.zeros(2 << _EXPONENT_BITS[itemsize], dtype=np.int64)
        return self.counts

    def _add(self, x: np.ndarray, counts: np.ndarray | None) -> None:
        n = x.size
        if n == 0:
            return
        if _fused is not None and x.dtype in _FLOATS and x.flags.c_contiguous:
            self._merge(n, *_fused.copy_stats(x, None, x.itemsize, counts))
            return
        if counts is not None:
            _count_exponents(x, counts)
        # numpy's float32 sums are pairwise: accurate enough, and twice as fast as float64.
        # Inf and NaN are data here, not mistakes: they are counted, not warned about.
        with np.errstate(over="ignore", invalid="ignore"):
            total_sum = float(x.sum())
            dev = self._scratch(x)
            np.subtract(x, x.dtype.type(total_sum / n), out=dev)
            np.square(dev, out=dev)  # not np.dot: BLAS threads would compete with training's
            m2_c = float(dev.sum())
            lo, hi = float(x.min()), float(x.max())
        bad = 0
        if not (math.isfinite(total_sum) and math.isfinite(m2_c)):
            bad = n - int(np.count_nonzero(np.isfinite(x)))
            if bad == 0 and x.dtype != np.float64:  # finite values whose float32 sums overflowed
                self._add(x.astype(np.float64), None)  # counted already
                return
        self._merge(n, total_sum, m2_c, lo, hi, bad)

    def _merge(self, n: int, total_sum: float, m2_c: float, lo: float, hi: float, bad: int) -> None:
        """Add a chunk's figures: its size, sum, sum of squared deviations from its
        mean, min, max and count of non-finite values."""
        self.nonfinite += bad
        self.sum += total_sum
        self.n, self.mean, self.m2 = merge_moments((self.n, self.mean, self.m2), (n, total_sum / n, m2_c))
        self.min = min(self.min, lo) if not math.isnan(lo) else math.nan
        self.max = max(self.max, hi) if not math.isnan(hi) else math.nan

    _buffers: dict = {}

    def _scratch(self, x: np.ndarray) -> np.ndarray:
        """A reused buffer for the deviations of one chunk (one per thread and dtype)."""
        key = (threading.get_ident(), x.dtype)
        buf = Digest._buffers.get(key)
        if buf is None or buf.size < x.size:
            buf = Digest._buffers[key] = np.empty(max(x.size, CHUNK), dtype=x.dtype)
        return buf[:x.size]

    def distribution(self) -> dict | None:
        """The tensor's values by sign and binary exponent (:func:`distribution`); None
        for a tensor that is not of a floating-point type."""
        return None if self.counts is None else distribution(self.counts)

    def checksum(self) -> str:
        return self.hasher.hexdigest()

    def stats(self) -> dict[str, float]:
        if self.n == 0:
            return {"nonfinite": 0}
        if self.nonfinite:  # merged means and deviations are NaN here: numpy's figures instead
            return {"norm": math.nan if math.isnan(self.min) else math.inf, "min": self.min, "max": self.max,
                    "mean": self.sum / self.n, "std": math.nan, "nonfinite": self.nonfinite}
        sumsq = self.m2 + self.n * self.mean * self.mean
        return {
            "norm": math.sqrt(sumsq) if sumsq >= 0 else math.nan,
            "min": self.min, "max": self.max, "mean": self.mean,
            "std": math.sqrt(self.m2 / self.n) if self.m2 >= 0 else math.nan,
            "nonfinite": self.nonfinite,
        }
