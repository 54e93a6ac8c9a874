"""Lossless per-tensor encoding of stored bytes, and an opt-in mantissa rounding.

A tensor's stored bytes (C order, in its storage dtype: see :mod:`datastates_hist.dtypes`)
are encoded piece by piece as they arrive: optionally as a *residual* against the same
tensor's value at earlier steps, then byte-shuffled with the element size and compressed
with zstd through blosc2. The residual works on each element's bit pattern as an
unsigned integer of the element's width, modulo 2**width (exact, so decoding gives back
every bit): the prediction is the base ``b1`` (one base) or the linear extrapolation
``2*b1 - b2`` (two bases: Adam's momentum makes consecutive updates alike), and the
residual ``x - prediction`` is zigzag-coded (small negative and positive differences
both become small numbers, whose high bytes the shuffle gathers into runs of zeros). A
float residual's elements are then *grouped* by the binary exponent of the base's ``b1``
(a predicted delta's: its prediction's; a stable sort the decoder repeats from the bases it has) and bit-shuffled: residuals
scale with the value's ulp, so each group holds residuals of one size. Every piece is cut into
independently compressed chunks of at most :data:`CHUNK_BYTES`, so decoding is chunked too
and blosc2's buffer limits never apply; a chunk that does not shrink is stored raw.

The chunk table ``[[raw_len, stored_len, flag], ...]`` is all a reader needs besides the
blob; :func:`check_chunks` validates one read from a manifest before anything trusts it.

The lossy part, applied only on request before encoding, is :mod:`.rounding`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import blosc2
import numpy as np

from .digest import _fused, scale_for
from .dtypes import torch_dtype

# blosc2 holds the GIL in compress2 and decompress2 unless told otherwise: the flusher's
# zstd then stalls the training thread's Python, and decoders on several threads run one
# at a time. The setting is the module's (process-wide); releasing the GIL is all it does.
blosc2.set_releasegil(True)

CHUNK_BYTES = 4 << 20
LOSSY_DTYPES = ("float32", "float64", "bfloat16", "float16")

# Chunk flags in the chunk table: bit 0, stored raw (else compressed); bit 1, a delta of a
# rounded tensor whose residual is shifted right by the bits rounding dropped (Encoder);
# bit 2, a delta of floats whose residual's elements are grouped by their base's exponent
# (Encoder).
COMPRESSED = 0
STORED_RAW = 1
SHIFTED = 2
GROUPED = 4

# Byte shuffle + zstd level 1: on a GPT's weights and AdamW state, level 3 is no smaller
# and a third as fast, bit shuffle 5-13% larger (tools/bench_codecs.py --compare). One
# blosc2 block per chunk: against blosc2's own choice (256 KiB here) it encoded the small
# GPT's residuals 15-20% faster and decoded them 35% faster, 0.1% smaller.
CLEVEL = 1
SHUFFLE = blosc2.Filter.SHUFFLE
# A grouped residual (GROUPED) is bit-shuffled: within a group the top bits of every
# element are zero, long runs that bit planes keep (small GPT, weights' deltas: 0.504 of the
# raw bytes byte-shuffled, 0.497 bit-shuffled; exp_avg_sq predicted 0.055 -> 0.037).
GROUPED_SHUFFLE = blosc2.Filter.BITSHUFFLE
# ... and its block split into one zstd stream per byte of the element (blosc2's own choice
# for zstd is one stream): each stream holds 8 bit planes alike, and zstd finds their runs
# sooner. Small GPT, grouped residuals: the same bytes (weights 0.497 -> 0.496), compressed
# 14% faster for the weights, 4% for exp_avg, 20% for exp_avg_sq; decoded as fast. Not a
# rounded tensor's: split, its residuals took 0.102 of their raw bytes instead of 0.074
# (weights, keep_bits=8).
GROUPED_SPLIT = blosc2.SplitMode.ALWAYS_SPLIT

# Explicit mantissa bits, and the unsigned type holding the bit pattern, per float dtype.
MANTISSA_BITS = {"float32": 23, "float64": 52, "bfloat16": 7, "float16": 10}
BITS_TYPE = {"float32": np.uint32, "float64": np.uint64, "bfloat16": np.uint16,
              "float16": np.uint16}

# The biased exponent of each float dtype's bit pattern, as (shift, bits): the key a
# grouped chunk's elements are ordered by. A difference of bit patterns scales with the
# value's ulp, so a residual's size follows its base's exponent; grouped by it, each
# zstd block sees residuals of one size. Small GPT (tools/bench_codecs.py): weights' deltas
# 0.526 -> 0.497 of the raw bytes, a restore point 0.318 -> 0.298; the grouping is a pass
# of about 1.8 GB/s each way.
# The exponent lies just above the explicit mantissa bits, below the sign.
GROUP_KEYS = {dtype: (bits, 8 * np.dtype(BITS_TYPE[dtype]).itemsize - 1 - bits)
              for dtype, bits in MANTISSA_BITS.items()}


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


class _Residuals:
    """The residual of a chunk against its prediction, and back, in scratch reused from
    block to block (numpy's in-place integer ufuncs wrap modulo 2**width and release the
    GIL). The scratch is allocated on first use, at most one block: an encoder is made
    per tensor and step, so one allocated whole up front costs :data:`BLOCK` bytes
    per tensor however small (4000 tensors of 8 bytes: 1 GB held until the step's end)."""

    BLOCK = 256 << 10  # bytes per pass: the several passes over a block stay in the CPU cache

    def __init__(self, itemsize: int):
        if itemsize not in _UNSIGNED:
            # complex128 (16 bytes): its two float64 halves are elements of their own
            itemsize = 8
        self.itemsize = itemsize
        self.unsigned, self.signed = _UNSIGNED[itemsize], _SIGNED[itemsize]
        self.shift = 8 * itemsize - 1
        self._scratch_buf = np.empty(0, self.unsigned)

    def _scratch(self, n: int) -> np.ndarray:
        """``n`` elements of scratch (one block's at most)."""
        if self._scratch_buf.size < n:
            self._scratch_buf = np.empty(n, self.unsigned)
        return self._scratch_buf[:n]

    def release(self) -> None:
        self._scratch_buf = np.empty(0, self.unsigned)

    def _blocks(self, *arrays):
        """The arrays (uint8, one length, or None) cut into blocks of :data:`BLOCK`, as elements."""
        for at in range(0, arrays[0].size, self.BLOCK):
            yield tuple(None if a is None else a[at:at + self.BLOCK].view(self.unsigned) for a in arrays)

    def _predict(self, base: np.ndarray, base2: np.ndarray | None) -> np.ndarray:
        if base2 is None:
            return base
        predicted = self._scratch(base.size)
        np.left_shift(base, 1, out=predicted)
        np.subtract(predicted, base2, out=predicted)
        return predicted

    def encode(self, x: np.ndarray, base: np.ndarray, base2: np.ndarray | None, out: np.ndarray,
               drop: int = 0) -> bool:
        """``out = zigzag(x - prediction)`` (all 1-D uint8 of one length). With ``drop``,
        the difference is first shifted right by ``drop`` bits if they are zero in every
        element (values rounded to fewer mantissa bits, and their prediction, end in
        ``drop`` zero bits; a NaN's payload may not): whether it was."""
        if not drop:
            for x_, b1, b2, diff in self._blocks(x, base, base2, out):
                np.subtract(x_, self._predict(b1, b2), out=diff)
                self._zigzag(diff)
            return False
        low = 0
        for x_, b1, b2, diff in self._blocks(x, base, base2, out):
            np.subtract(x_, self._predict(b1, b2), out=diff)
            low |= int(np.bitwise_or.reduce(diff)) & ((1 << drop) - 1)
        shift = self.signed(0 if low else drop)
        for (diff,) in self._blocks(out):
            signed = diff.view(self.signed)
            np.right_shift(signed, shift, out=signed)  # arithmetic: the sign is kept
            self._zigzag(diff)
        return not low

    def _zigzag(self, diff: np.ndarray) -> None:
        signed = diff.view(self.signed)
        sign = self._scratch(diff.size).view(self.signed)
        np.right_shift(signed, self.shift, out=sign)  # all ones where negative
        np.left_shift(signed, 1, out=signed)
        np.bitwise_xor(signed, sign, out=signed)

    def decode(self, residual: np.ndarray, base: np.ndarray, base2: np.ndarray | None, shift: int = 0) -> None:
        """Turn ``residual`` (decompressed, in place) back into the element bytes
        (``shift``: the bits the encoder shifted the difference right by)."""
        for z, b1, b2 in self._blocks(residual, base, base2):
            negative = self._scratch(z.size)
            np.bitwise_and(z, 1, out=negative)
            np.negative(negative, out=negative)  # 0 or all ones
            np.right_shift(z, 1, out=z)
            np.bitwise_xor(z, negative, out=z)
            if shift:
                np.left_shift(z, self.unsigned(shift), out=z)
            np.add(z, b1, out=z)
            if b2 is not None:  # z + 2*b1 - b2, without a second scratch
                np.add(z, b1, out=z)
                np.subtract(z, b2, out=z)


def group(src: np.ndarray, key: np.ndarray, dst: np.ndarray, dtype: str, inverse: bool = False) -> None:
    """``dst`` = the elements of ``src`` (1-D uint8, whole elements of ``dtype``, a float
    dtype of :data:`GROUP_KEYS`) in a stable order by the biased exponent of ``key``'s
    same elements; with ``inverse``, that order undone. ``dst`` is not ``src``."""
    shift, bits = GROUP_KEYS[dtype]
    itemsize = torch_dtype(dtype).itemsize
    if _fused is not None:
        _fused.group(src, key, dst, itemsize, shift, bits, inverse)
        return
    unsigned = _UNSIGNED[itemsize]
    k = key.view(unsigned)
    order = np.argsort((k >> unsigned(shift)) & unsigned((1 << bits) - 1), kind="stable")
    if inverse:
        dst.view(unsigned)[order] = src.view(unsigned)
    else:
        np.take(src.view(unsigned), order, out=dst.view(unsigned))


def _check_bases(base, base2, size: int, of: str) -> None:
    for what, b in (("base", base), ("base2", base2)):
        if b is not None:
            check_byte_array(what, b)
            if b.size != size:
                raise ValueError(f"{what} has {b.size} bytes, {of} {size}")


def check_byte_array(what: str, array, writeable: bool = False) -> None:
    if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 1:
        raise ValueError(f"{what} must be a 1-D uint8 numpy array")
    if not array.flags.c_contiguous:
        raise ValueError(f"{what} must be contiguous")
    if writeable and not array.flags.writeable:
        raise ValueError(f"{what} must be writeable")


class _NormAccumulator:
    """Sums ||x - base||^2 and ||base||^2 chunk by chunk, in float64, for one float dtype.

    Each chunk is converted into preallocated float scratch (bfloat16 through its bit
    pattern, float16 by a cast), so the whole tensor is read once, in cache-sized steps.
    Finite values whose squares overflow (float64 beyond about 1e150; float32 beyond about
    1e19, which numpy squares in float32) show as an infinite sum: that chunk is summed
    again in float64, scaled by a power of two (:func:`digest.scale_for`), and so are the
    sums from then on.
    """

    def __init__(self, dtype: str):
        self.dtype = dtype
        self.diff_sq = 0.0
        self.base_sq = 0.0
        # both sums are of the values times 2**-scale: 0 but where finite values' squares
        # overflowed; the ratio of the two is the same
        self.scale = 0
        self._value_type = np.float64 if dtype == "float64" else np.float32
        # float32 and float64 are read in place; 16-bit floats are widened into scratch.
        self._widened = dtype in ("bfloat16", "float16")
        self._diff = self._base = np.empty(0, self._value_type)
        self._bits = np.empty(0, np.uint32)

    def _grow_scratch(self, n: int) -> None:
        if self._diff.size < n:
            self._diff = np.empty(n, self._value_type)
            if self._widened:
                self._base = np.empty(n, np.float32)
            if self.dtype == "bfloat16":
                self._bits = np.empty(n, np.uint32)

    def _widen(self, raw: np.ndarray, out: np.ndarray) -> np.ndarray:
        if self.dtype == "bfloat16":
            # A bfloat16 is the top half of the float32 with the same bits.
            bits = self._bits[: out.size]
            np.copyto(bits, raw.view(np.uint16), casting="unsafe")
            np.left_shift(bits, 16, out=bits)
            np.copyto(out, bits.view(np.float32))
        else:
            np.copyto(out, raw.view(np.float16), casting="unsafe")
        return out

    def add(self, x_raw: np.ndarray, base_raw: np.ndarray, itemsize: int) -> None:
        n = x_raw.size // itemsize
        self._grow_scratch(n)
        diff = self._diff[:n]
        if self._widened:
            x = self._widen(x_raw, diff)
            b = self._widen(base_raw, self._base[:n])
        else:
            x, b = x_raw.view(self._value_type), base_raw.view(self._value_type)
        with np.errstate(all="ignore"):  # NaN or inf make the ratio None, not a warning
            np.subtract(x, b, out=diff)
            # Partial sums in the element type (BLAS), accumulated across chunks in float64.
            self.add_sums(float(np.dot(diff, diff)), float(np.dot(b, b)), x_raw, base_raw)

    def add_sums(self, diff_sq: float, base_sq: float, x_raw: np.ndarray, base_raw: np.ndarray) -> None:
        """Add a chunk's ``||x - base||**2`` and ``||base||**2`` of its values as they are
        (the kernel's or numpy's); its bytes ``x_raw`` and ``base_raw`` are read again
        only where a sum is infinite or NaN."""
        if self.scale:
            diff_sq, base_sq = math.ldexp(diff_sq, -2 * self.scale), math.ldexp(base_sq, -2 * self.scale)
        diff_sq, base_sq = self.diff_sq + diff_sq, self.base_sq + base_sq
        if diff_sq < math.inf and base_sq < math.inf:  # neither infinite nor NaN
            self.diff_sq, self.base_sq = diff_sq, base_sq
        else:
            self._add_scaled(x_raw, base_raw)

    def _add_scaled(self, x_raw: np.ndarray, base_raw: np.ndarray) -> None:
        """:meth:`add_sums` of a chunk whose sums overflowed or whose values are not all
        finite: the latter make the ratio None, as their sums always did."""
        if not (math.isfinite(self.diff_sq) and math.isfinite(self.base_sq)):  # a non-finite value seen already
            return
        with np.errstate(invalid="ignore"):  # a signalling NaN raises "invalid" when cast
            x, b = self._float64(x_raw), self._float64(base_raw)
            largest = max(float(np.abs(x).max()), float(np.abs(b).max()))
        if not math.isfinite(largest):  # NaN propagates through max
            self.diff_sq = self.base_sq = math.nan
            return
        k = max(self.scale, scale_for(largest))
        if k != self.scale:  # exact: a power of two
            self.diff_sq = math.ldexp(self.diff_sq, 2 * (self.scale - k))
            self.base_sq = math.ldexp(self.base_sq, 2 * (self.scale - k))
            self.scale = k
        unit = math.ldexp(1.0, -k)
        x *= unit
        b *= unit
        x -= b
        self.diff_sq += float(np.square(x, out=x).sum())
        self.base_sq += float(np.square(b, out=b).sum())

    def _float64(self, raw: np.ndarray) -> np.ndarray:
        """A chunk's values, from its bytes, as a new float64 array."""
        if self._widened:
            n = raw.size // 2
            self._grow_scratch(n)
            return self._widen(raw, np.empty(n, np.float32)).astype(np.float64)
        return raw.view(self._value_type).astype(np.float64)

    def ratio(self) -> float | None:
        if self.base_sq == 0.0:
            return None
        ratio = (self.diff_sq / self.base_sq) ** 0.5
        if ratio == math.inf and math.isfinite(self.diff_sq):  # the quotient overflowed, its root need not
            ratio = math.sqrt(self.diff_sq) / math.sqrt(self.base_sq)
        # NaN or inf in the tensors make the ratio meaningless (and unstorable as JSON).
        return ratio if np.isfinite(ratio) else None


@functools.cache
def _cparams(typesize: int, grouped: bool = False, split: bool = False) -> dict:
    """blosc2's compression parameters for elements of ``typesize`` bytes (``grouped``: of
    a grouped residual; ``split``: in one stream per byte of the element), as the dict that
    ``compress2`` takes (given a ``CParams``, it converts it with ``dataclasses.asdict`` at
    every call: 23 ms per checkpoint of the small GPT)."""
    extra = {"filters": [GROUPED_SHUFFLE if grouped else SHUFFLE]}
    if split:
        extra["splitmode"] = GROUPED_SPLIT
    return dataclasses.asdict(blosc2.CParams(codec=blosc2.Codec.ZSTD, clevel=CLEVEL, typesize=typesize,
                                             nthreads=1, blocksize=CHUNK_BYTES, **extra))


class Encoder:
    """Encodes one tensor, piece by piece.

    ``dtype`` is the tensor's torch dtype name without ``torch.`` (``"float32"``,
    ``"bfloat16"``, ``"int64"``...): it gives the element size for the shuffle and tells
    whether an update ratio can be computed. With ``delta``, every piece is stored as its
    residual against the base's bytes at the same range (and, if given, the second
    base's: the base's own base), which the caller passes to :meth:`add`. ``drop``: a
    delta of values rounded to fewer mantissa bits (whose bases were rounded alike) stores
    its residual shifted right by the ``drop`` bits rounding made zero, chunk by chunk
    where they are (flag :data:`SHIFTED`): the zigzag no longer spreads the sign over them.
    ``grouped``: a float delta's residual is stored grouped (flag :data:`GROUPED`), and then
    never shifted.
    """

    def __init__(self, dtype: str, delta: bool, drop: int = 0, grouped: bool = True):
        self.dtype = dtype
        self.itemsize = torch_dtype(dtype).itemsize
        self.delta = delta
        self.grouped = grouped and delta and dtype in GROUP_KEYS
        # bit-shuffled, a grouped residual's zero low bits cost as little unshifted (the
        # small GPT's rounded weights: 0.25% less): shifting is for ungrouped chunks
        self.drop = drop if delta and not self.grouped else 0
        self._cparams = _cparams(self.itemsize, self.grouped, split=self.grouped and not drop)
        self._stored: list[bytes] = []
        self._chunks: list[list[int]] = []
        self._residual_buf = self._grouped_buf = self._predicted_buf = np.empty(0, np.uint8)
        self._residuals = _Residuals(self.itemsize)
        self._norms = _NormAccumulator(dtype) if delta and dtype in LOSSY_DTYPES else None
        # the C kernel (None: numpy) computes the residual, and the norms when this is 1
        # (float32) or 2 (float64); 16-bit floats are widened for their norms by numpy
        self._fused_norms = None
        if _fused is not None and delta:
            self._fused_norms = {"float32": 1, "float64": 2}.get(dtype, 0)
            if self._norms is not None and not self._fused_norms:
                self._fused_norms = None  # bfloat16, float16: numpy, which widens them
        self._finished = False

    def skip_ratio(self) -> None:
        """Compute no update ratio (:meth:`finish` returns None for it): for a delta against
        a prediction, whose ratio is against the tensor's base instead, computed with the
        prediction. Only before the first :meth:`add`."""
        if self._chunks:
            raise RuntimeError("Encoder.skip_ratio called after add")
        self._norms = None
        if self._fused_norms:
            self._fused_norms = 0

    def add(self, piece: np.ndarray, base: np.ndarray | None, base2: np.ndarray | None = None,
            keep: np.ndarray | None = None, compress: bool = True,
            predict: Callable[[int, int, np.ndarray], None] | None = None) -> None:
        """Encode the next consecutive byte range of the tensor (``base``, ``base2``: the
        same range of the base tensors, or None without delta). ``predict(start, stop,
        into)``, instead of the bases: a delta against a prediction, which writes the
        prediction of the piece's bytes ``[start, stop)`` into ``into``, chunk by chunk
        (one chunk's scratch, as :func:`decode` asks for it). ``keep`` (or None) gets a
        copy of the piece once the bases' bytes are read, so it may be ``base2`` itself.
        Without ``compress``, the piece's chunks are stored raw (:data:`STORED_RAW`: a
        delta's residual, ungrouped), which costs one pass instead of the entropy coder's.
        No other array is modified."""
        if self._finished:
            raise RuntimeError("Encoder.add called after finish")
        check_byte_array("piece", piece)
        if piece.size % self.itemsize:
            raise ValueError(f"piece of {piece.size} bytes is not a whole number of "
                             f"{self.itemsize}-byte {self.dtype} elements")
        if predict is not None and (base is not None or base2 is not None):
            raise ValueError("a delta against a base or a prediction, not both")
        if predict is not None and not self.delta:
            raise ValueError("a prediction given to an encoder without delta")
        if self.delta:
            if base is None and predict is None:
                raise ValueError("a delta encoder needs the base's bytes for every piece")
            _check_bases(base, base2, piece.size, "the piece")
        elif base is not None or base2 is not None:
            raise ValueError("base given to an encoder without delta")
        if keep is not None:
            check_byte_array("keep", keep, writeable=True)
            if keep.size != piece.size:
                raise ValueError(f"keep has {keep.size} bytes, the piece {piece.size}")
        for start in range(0, piece.size, CHUNK_BYTES):
            chunk = piece[start:start + CHUNK_BYTES]
            kept = None if keep is None else keep[start:start + CHUNK_BYTES]
            original, flag = chunk, 0
            if self.delta:
                if predict is not None:
                    b1, b2 = self._scratch("_predicted_buf", chunk.size), None
                    predict(start, start + chunk.size, b1)
                else:
                    cut = slice(start, start + CHUNK_BYTES)
                    b1, b2 = base[cut], None if base2 is None else base2[cut]
                residual = self._scratch("_residual_buf", chunk.size)
                if self._fused_norms is not None and not self.drop:
                    # one pass: the residual, the update ratio's sums and the anchor's copy
                    diff_sq, base_sq = _fused.residual(chunk, b1, b2, residual, kept, self._residuals.itemsize,
                                                       self._fused_norms)
                    if self._fused_norms:
                        self._norms.add_sums(diff_sq, base_sq, chunk, b1)
                    kept = None
                else:
                    if self._norms is not None:
                        self._norms.add(chunk, b1, self.itemsize)
                    if self._residuals.encode(chunk, b1, b2, residual, self.drop):
                        flag = SHIFTED
                chunk = residual
                if self.grouped and compress:
                    chunk = self._group(residual, b1)
                    flag |= GROUPED
            if kept is not None:  # once the bases are read: keep may be base2's buffer
                kept[:] = original
            self._add_chunk(chunk, flag, compress)

    def _scratch(self, name: str, size: int) -> np.ndarray:
        """``size`` bytes of the chunk-sized scratch ``name``, reused from chunk to chunk."""
        buf = getattr(self, name)
        if buf.size < size:
            buf = np.empty(size, np.uint8)
            setattr(self, name, buf)
        return buf[:size]

    def _group(self, residual: np.ndarray, base: np.ndarray) -> np.ndarray:
        """The residual's elements grouped by the exponent of the first base's (``b1``,
        or a predicted delta's prediction: the decoder has either before the residual)."""
        out = self._scratch("_grouped_buf", residual.size)
        group(residual, base, out, self.dtype)
        return out

    def _add_chunk(self, chunk: np.ndarray, flags: int, compress: bool = True) -> None:
        compressed = blosc2.compress2(chunk, cparams=self._cparams) if compress else None
        if compressed is not None and len(compressed) < chunk.size:
            self._stored.append(compressed)
            self._chunks.append([chunk.size, len(compressed), COMPRESSED | flags])
        else:
            self._stored.append(chunk.tobytes())
            self._chunks.append([chunk.size, chunk.size, STORED_RAW | flags])

    def finish(self) -> tuple[np.ndarray, list[list[int]], float | None]:
        """``(blob, chunks, update_ratio)``: all chunks concatenated, the chunk table
        ``[[raw_len, stored_len, flag], ...]`` (flag 0 compressed, 1 stored raw), and for
        a delta of a float tensor ``||x - base|| / ||base||`` (None otherwise, when the
        base is all zeros, or when either holds NaN or inf). The blob is read-only."""
        self._finished = True
        blob = np.frombuffer(b"".join(self._stored), np.uint8)
        self._stored = []
        self._residual_buf = self._grouped_buf = self._predicted_buf = np.empty(0, np.uint8)
        self._residuals.release()
        ratio = self._norms.ratio() if self._norms is not None else None
        return blob, self._chunks, ratio


def check_chunks(chunks, raw_nbytes: int, stored_nbytes: int, itemsize: int, shifts: bool = False,
                 groups: bool = False) -> None:
    """Raise ValueError unless ``chunks`` is a well-formed chunk table for a tensor of
    ``raw_nbytes`` bytes, encoded as a blob of ``stored_nbytes`` bytes (``shifts``: a
    delta of a rounded tensor, whose chunks may be :data:`SHIFTED`; ``groups``: a delta
    of floats, whose chunks may be :data:`GROUPED`)."""
    if not isinstance(chunks, (list, tuple)):
        raise ValueError(f"chunk table must be a list, got {type(chunks).__name__}")
    allowed = STORED_RAW | (SHIFTED if shifts else 0) | (GROUPED if groups else 0)
    raw_total = stored_total = 0
    for i, entry in enumerate(chunks):
        if (not isinstance(entry, (list, tuple)) or len(entry) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)):
            raise ValueError(f"chunk {i}: entry must be 3 integers [raw_len, stored_len, flag], "
                             f"got {entry!r}")
        raw_len, stored_len, flag = entry
        if raw_len <= 0 or stored_len < 0:
            raise ValueError(f"chunk {i}: raw_len must be positive and stored_len "
                             f"non-negative, got {raw_len} and {stored_len}")
        if flag < 0 or flag & ~allowed:
            raise ValueError(f"chunk {i}: flag must be 0 (compressed) or 1 (stored raw)"
                             f"{', plus 2 (shifted)' if shifts else ''}{', plus 4 (grouped)' if groups else ''}, "
                             f"got {flag}")
        if raw_len > CHUNK_BYTES:
            raise ValueError(f"chunk {i}: raw_len {raw_len} exceeds the chunk size {CHUNK_BYTES}")
        if raw_len % itemsize:
            raise ValueError(f"chunk {i}: raw_len {raw_len} is not a multiple of the "
                             f"element size {itemsize}")
        if flag & STORED_RAW and stored_len != raw_len:
            raise ValueError(f"chunk {i}: stored raw but stored_len {stored_len} != raw_len {raw_len}")
        if not flag & STORED_RAW and not (blosc2.MIN_HEADER_LENGTH <= stored_len
                                       <= raw_len + blosc2.MAX_OVERHEAD):
            raise ValueError(f"chunk {i}: compressed stored_len {stored_len} is impossible "
                             f"for raw_len {raw_len}")
        raw_total += raw_len
        stored_total += stored_len
    if raw_total != raw_nbytes:
        raise ValueError(f"chunk table covers {raw_total} bytes, the tensor has {raw_nbytes}")
    if stored_total != stored_nbytes:
        raise ValueError(f"chunk table stores {stored_total} bytes, the blob has {stored_nbytes}")


def decode(blob: np.ndarray, chunks: list[list[int]], itemsize: int, out: np.ndarray,
           base: np.ndarray | None = None, base2: np.ndarray | None = None, drop: int = 0,
           dtype: str | None = None, predict: Callable[[int, int, np.ndarray], None] | None = None) -> None:
    """Decode ``blob`` into ``out`` (``sum(raw_len)`` bytes), adding back the prediction
    from ``base`` (and ``base2``) for a delta (``drop``: the bits a :data:`SHIFTED` chunk's
    residual was shifted by; ``dtype``: the tensor's, which a :data:`GROUPED` chunk's
    order follows). ``predict(start, stop, into)``, instead of ``base``: a delta against a
    prediction computed chunk by chunk, which writes the prediction of bytes
    ``[start, stop)`` into ``into`` (the whole prediction is never held: one chunk's
    scratch, reused while it is in the CPU cache). Raises ValueError on any inconsistency."""
    check_byte_array("blob", blob)
    check_byte_array("out", out, writeable=True)
    if base2 is not None and base is None:
        raise ValueError("a second base without a first")
    if predict is not None and base is not None:
        raise ValueError("a delta against a base or a prediction, not both")
    _check_bases(base, base2, out.size, "the tensor")
    residuals = _Residuals(itemsize)
    delta = base is not None or predict is not None
    groups = delta and dtype in GROUP_KEYS
    if groups and torch_dtype(dtype).itemsize != itemsize:
        raise ValueError(f"a {dtype} delta of {itemsize}-byte elements")
    check_chunks(chunks, out.size, blob.size, itemsize, shifts=bool(drop) and delta, groups=groups)
    grouped = np.empty(max((raw for raw, _, flag in chunks if flag & GROUPED), default=0), np.uint8)
    predicted = np.empty(max((raw for raw, _, _ in chunks), default=0) if predict else 0, np.uint8)
    src = dst = 0
    for i, (raw_len, stored_len, flag) in enumerate(chunks):
        stored = blob[src:src + stored_len]
        target = out[dst:dst + raw_len]
        residual = grouped[:raw_len] if flag & GROUPED else target  # the order undone into target
        if flag & STORED_RAW:
            np.copyto(residual, stored)
        else:
            # The header's sizes must match the table before blosc2 acts on them.
            nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(stored)
            if nbytes != raw_len or cbytes != stored_len:
                raise ValueError(f"chunk {i}: its header says {nbytes} bytes compressed to "
                                 f"{cbytes}, the chunk table {raw_len} to {stored_len}")
            try:
                blosc2.decompress2(stored, dst=residual, nthreads=1)
            except (RuntimeError, ValueError) as e:
                raise ValueError(f"chunk {i} does not decompress: {e}") from None
        if delta:
            if predict is not None:
                b1, b2 = predicted[:raw_len], None
                predict(dst, dst + raw_len, b1)
            else:
                b1, b2 = base[dst:dst + raw_len], None if base2 is None else base2[dst:dst + raw_len]
            if flag & GROUPED:
                group(residual, b1, target, dtype, inverse=True)
            shift = drop if flag & SHIFTED else 0
            if _fused is not None:  # one pass of the C kernel
                _fused.unresidual(target, b1, b2, residuals.itemsize, shift)
            else:
                residuals.decode(target, b1, b2, shift)
        src += stored_len
        dst += raw_len
