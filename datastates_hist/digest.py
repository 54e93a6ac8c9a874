"""Checksums and statistics of tensors, computed piece by piece during the flush.

The checksum is xxh3-64 of the stored bytes in C order (xxhash releases the GIL).
Statistics (L2 norm, min, max, mean, population std, count of non-finite values)
are computed in chunks that fit the CPU cache and combined with Chan's parallel
formula, so a tensor streamed through the host cache gets the same figures as
one read whole. The distribution of a floating-point tensor is counted with them:
its values by sign and binary exponent (:func:`distribution`), exact, and cheap
enough to keep for every step. The C kernel ``_fused`` (float64 accumulators, one pass over
memory that also makes the snapshot's copy) does a chunk when it is built;
numpy otherwise. Finite float64 values beyond about 1e150, whose squares' sums
overflow float64, are summed scaled by a power of two (:func:`scale_for`); only a chunk
whose figures came out infinite or NaN is read again for that, so the common path pays
one test per chunk.
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
# Where squares overflow, values are scaled to at most 2**SCALE_TOP (scale_for): 2**120
# squared deviations of such values, at most 2**(2*SCALE_TOP+2) each, sum below 2**1024.
SCALE_TOP = 448


def scale_for(largest: float) -> int:
    """The power of two ``k`` that brings values of magnitude up to ``largest`` (finite)
    to at most ``2**SCALE_TOP`` once multiplied by ``2**-k`` (0 for those there already).
    Multiplying by a power of two is exact but for values that become subnormal, some
    ``2**-1469`` times the largest or less: far too small to change a sum of squares."""
    return max(0, math.frexp(largest)[1] - SCALE_TOP)


def scaled_moments(x: np.ndarray, k: int) -> tuple[float, float]:
    """``(sum, m2)`` of float values ``x`` times ``2**-k``, in float64, deviations taken
    from the first value (as the C kernel does: a constant chunk gets exactly 0), then from
    the mean. For chunks whose figures overflowed: it makes a copy and three passes."""
    x = x.astype(np.float64) * math.ldexp(1.0, -k)
    first = float(x[0])
    x -= first
    shifted = float(x.sum())
    x -= shifted / x.size
    return first * x.size + shifted, float(np.square(x, out=x).sum())


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
    sum of squared deviations from its mean ``m2`` (Chan's parallel formula). Both parts'
    means and deviations must be of values scaled alike (:class:`Digest`, ``scale``); an
    infinite or NaN ``m2`` from finite ones says that they overflowed."""
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
        # mean and m2 are of the values times 2**-scale: 0 but for values whose squares
        # overflow float64 (scale_for), where it grows with the largest value
        self.scale = 0
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
                                                           self._counts(chunk.itemsize)), chunk)
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
            self._merge(n, *_fused.copy_stats(x, None, x.itemsize, counts), x)
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
        self._merge(n, total_sum, m2_c, lo, hi, bad, x)

    def _merge(self, n: int, total_sum: float, m2_c: float, lo: float, hi: float, bad: int,
               values: np.ndarray) -> None:
        """Add a chunk's figures: its size, sum, sum of squared deviations from its
        mean, min, max and count of non-finite values; ``values`` its float values, read
        again only where finite values' figures overflowed."""
        self.nonfinite += bad
        self.sum += total_sum
        self.min = min(self.min, lo) if not math.isnan(lo) else math.nan
        self.max = max(self.max, hi) if not math.isnan(hi) else math.nan
        if self.scale:
            self._merge_scaled(n, total_sum, m2_c, values)
            return
        moments = merge_moments((self.n, self.mean, self.m2), (n, total_sum / n, m2_c))
        # an overflow (the chunk's sums or the merge's) shows as an infinite or NaN m2;
        # with a non-finite value counted, stats() reads the plain sum instead
        if not math.isfinite(moments[2]) and not self.nonfinite:
            self._merge_scaled(n, total_sum, m2_c, values)
            return
        self.n, self.mean, self.m2 = moments

    def _merge_scaled(self, n: int, total_sum: float, m2_c: float, values: np.ndarray) -> None:
        """:meth:`_merge` for finite values whose squares overflow float64: the figures
        scaled by ``2**-scale``, a power of two for the largest value so far
        (:func:`scale_for`), and the chunk's own figures computed again from its values,
        scaled, where they overflowed."""
        if self.nonfinite:  # stats() reads the plain sum: only the count matters now
            self.n += n
            return
        k = max(self.scale, scale_for(max(-self.min, self.max)))
        if k != self.scale:  # exact: a power of two
            self.mean = math.ldexp(self.mean, self.scale - k)
            self.m2 = math.ldexp(self.m2, 2 * (self.scale - k))
            self.scale = k
        if math.isfinite(total_sum) and math.isfinite(m2_c):
            total_sum, m2_c = math.ldexp(total_sum, -k), math.ldexp(m2_c, -2 * k)
        else:
            total_sum, m2_c = scaled_moments(values, k)
        self.n, self.mean, self.m2 = merge_moments((self.n, self.mean, self.m2), (n, total_sum / n, m2_c))

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
        k, mean, m2 = self.scale, self.mean, self.m2
        sumsq = m2 + self.n * mean * mean
        if sumsq == math.inf:  # n * mean**2 overflowed (a mean beyond about 1e150): scaled as values are
            extra = scale_for(max(-self.min, self.max)) - k
            mean, m2, k = math.ldexp(mean, -extra), math.ldexp(m2, -2 * extra), k + extra
            sumsq = m2 + self.n * mean * mean
        unit = math.ldexp(1.0, k)  # a product, not ldexp: a norm beyond float64's largest is inf, not an error
        return {
            "norm": math.sqrt(sumsq) * unit if sumsq >= 0 else math.nan,
            "min": self.min, "max": self.max, "mean": math.ldexp(self.mean, self.scale),
            "std": math.sqrt(m2 / self.n) * unit if m2 >= 0 else math.nan,
            "nonfinite": self.nonfinite,
        }
