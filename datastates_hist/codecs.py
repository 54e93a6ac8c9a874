"""Lossless per-tensor encoding of stored bytes, and an opt-in mantissa rounding.

A tensor's stored bytes (C order, in its storage dtype: see :mod:`datastates_hist.dtypes`)
are encoded piece by piece as they arrive: optionally as a *residual* against the same
tensor's value at earlier steps, then byte-shuffled with the element size and compressed
with zstd through blosc2. The residual works on each element's bit pattern as an
unsigned integer of the element's width, modulo 2**width (exact, so decoding gives back
every bit): the prediction is the base ``b1`` (one base) or the linear extrapolation
``2*b1 - b2`` (two bases: Adam's momentum makes consecutive updates alike), and the
residual ``x - prediction`` is zigzag-coded (small negative and positive differences
both become small numbers, whose high bytes the shuffle gathers into runs of zeros). Every piece is cut into
independently compressed chunks of at most :data:`CHUNK_BYTES`, so decoding is chunked too
and blosc2's buffer limits never apply; a chunk that does not shrink is stored raw.

The chunk table ``[[raw_len, stored_len, flag], ...]`` is all a reader needs besides the
blob; :func:`check_chunks` validates one read from a manifest before anything trusts it.

:func:`round_mantissa` is the lossy part, applied only on request before encoding: it
rounds floats to ``keep_bits`` explicit mantissa bits (round to nearest, ties to even),
which makes the low bits zero and the residuals far more compressible.
"""

from __future__ import annotations

import blosc2
import numpy as np

from .dtypes import torch_dtype

CHUNK_BYTES = 4 << 20
LOSSY_DTYPES = ("float32", "float64", "bfloat16", "float16")

# Chunk flags in the chunk table.
COMPRESSED = 0
STORED_RAW = 1

# Byte shuffle + zstd level 1: on a GPT's weights and AdamW state, level 3 is no smaller
# and a third as fast, bit shuffle 5-13% larger (tools/bench_codecs.py --compare).
CLEVEL = 1
SHUFFLE = blosc2.Filter.SHUFFLE

# Explicit mantissa bits, and the unsigned type holding the bit pattern, per float dtype.
_MANTISSA_BITS = {"float32": 23, "float64": 52, "bfloat16": 7, "float16": 10}
_BITS_TYPE = {"float32": np.uint32, "float64": np.uint64, "bfloat16": np.uint16,
              "float16": np.uint16}


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


class _Residuals:
    """The residual of a chunk against its prediction, and back, in preallocated scratch
    (numpy's in-place integer ufuncs wrap modulo 2**width and release the GIL)."""

    BLOCK = 256 << 10  # bytes per pass: the several passes over a block stay in the CPU cache

    def __init__(self, itemsize: int):
        if itemsize not in _UNSIGNED:
            # complex128 (16 bytes): its two float64 halves are elements of their own
            itemsize = 8
        self.unsigned, self.signed = _UNSIGNED[itemsize], _SIGNED[itemsize]
        self.shift = 8 * itemsize - 1
        self._scratch = np.empty(self.BLOCK, np.uint8).view(self.unsigned)

    def _blocks(self, *arrays):
        """The arrays (uint8, one length, or None) cut into blocks of :data:`BLOCK`, as elements."""
        for at in range(0, arrays[0].size, self.BLOCK):
            yield tuple(None if a is None else a[at:at + self.BLOCK].view(self.unsigned) for a in arrays)

    def _predict(self, base: np.ndarray, base2: np.ndarray | None) -> np.ndarray:
        if base2 is None:
            return base
        predicted = self._scratch[:base.size]
        np.left_shift(base, 1, out=predicted)
        np.subtract(predicted, base2, out=predicted)
        return predicted

    def encode(self, x: np.ndarray, base: np.ndarray, base2: np.ndarray | None, out: np.ndarray) -> None:
        """``out = zigzag(x - prediction)`` (all 1-D uint8 of one length)."""
        for x_, b1, b2, diff in self._blocks(x, base, base2, out):
            np.subtract(x_, self._predict(b1, b2), out=diff)
            signed = diff.view(self.signed)
            sign = self._scratch[:diff.size].view(self.signed)
            np.right_shift(signed, self.shift, out=sign)  # all ones where negative
            np.left_shift(signed, 1, out=signed)
            np.bitwise_xor(signed, sign, out=signed)

    def decode(self, residual: np.ndarray, base: np.ndarray, base2: np.ndarray | None) -> None:
        """Turn ``residual`` (decompressed, in place) back into the element bytes."""
        for z, b1, b2 in self._blocks(residual, base, base2):
            negative = self._scratch[:z.size]
            np.bitwise_and(z, 1, out=negative)
            np.negative(negative, out=negative)  # 0 or all ones
            np.right_shift(z, 1, out=z)
            np.bitwise_xor(z, negative, out=z)
            np.add(z, b1, out=z)
            if b2 is not None:  # z + 2*b1 - b2, without a second scratch
                np.add(z, b1, out=z)
                np.subtract(z, b2, out=z)


def _check_bases(base, base2, size: int, of: str) -> None:
    for what, b in (("base", base), ("base2", base2)):
        if b is not None:
            _check_byte_array(what, b)
            if b.size != size:
                raise ValueError(f"{what} has {b.size} bytes, {of} {size}")


def _check_byte_array(what: str, array, writeable: bool = False) -> None:
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
    """

    def __init__(self, dtype: str):
        self.dtype = dtype
        self.diff_sq = 0.0
        self.base_sq = 0.0
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
            self.diff_sq += float(np.dot(diff, diff))
            self.base_sq += float(np.dot(b, b))

    def ratio(self) -> float | None:
        if self.base_sq == 0.0:
            return None
        ratio = (self.diff_sq / self.base_sq) ** 0.5
        # NaN or inf in the tensors make the ratio meaningless (and unstorable as JSON).
        return ratio if np.isfinite(ratio) else None


class Encoder:
    """Encodes one tensor, piece by piece.

    ``dtype`` is the tensor's torch dtype name without ``torch.`` (``"float32"``,
    ``"bfloat16"``, ``"int64"``...): it gives the element size for the shuffle and tells
    whether an update ratio can be computed. With ``delta``, every piece is stored as its
    residual against the base's bytes at the same range (and, if given, the second
    base's: the base's own base), which the caller passes to :meth:`add`.
    """

    def __init__(self, dtype: str, delta: bool):
        self.dtype = dtype
        self.itemsize = torch_dtype(dtype).itemsize
        self.delta = delta
        self._cparams = blosc2.CParams(codec=blosc2.Codec.ZSTD, clevel=CLEVEL,
                                       typesize=self.itemsize, nthreads=1, filters=[SHUFFLE])
        self._stored: list[bytes] = []
        self._chunks: list[list[int]] = []
        self._residual_buf = np.empty(0, np.uint8)
        self._residuals = _Residuals(self.itemsize)
        self._norms = _NormAccumulator(dtype) if delta and dtype in LOSSY_DTYPES else None
        self._finished = False

    def add(self, piece: np.ndarray, base: np.ndarray | None, base2: np.ndarray | None = None) -> None:
        """Encode the next consecutive byte range of the tensor (``base``, ``base2``: the
        same range of the base tensors, or None without delta). No array is modified."""
        if self._finished:
            raise RuntimeError("Encoder.add called after finish")
        _check_byte_array("piece", piece)
        if piece.size % self.itemsize:
            raise ValueError(f"piece of {piece.size} bytes is not a whole number of "
                             f"{self.itemsize}-byte {self.dtype} elements")
        if self.delta:
            if base is None:
                raise ValueError("a delta encoder needs the base's bytes for every piece")
            _check_bases(base, base2, piece.size, "the piece")
        elif base is not None or base2 is not None:
            raise ValueError("base given to an encoder without delta")
        for start in range(0, piece.size, CHUNK_BYTES):
            chunk = piece[start:start + CHUNK_BYTES]
            if self.delta:
                base_chunk = base[start:start + CHUNK_BYTES]
                if self._norms is not None:
                    self._norms.add(chunk, base_chunk, self.itemsize)
                if self._residual_buf.size < chunk.size:
                    self._residual_buf = np.empty(chunk.size, np.uint8)
                residual = self._residual_buf[: chunk.size]
                self._residuals.encode(chunk, base_chunk, None if base2 is None else
                                       base2[start:start + CHUNK_BYTES], residual)
                chunk = residual
            self._add_chunk(chunk)

    def _add_chunk(self, chunk: np.ndarray) -> None:
        compressed = blosc2.compress2(chunk, cparams=self._cparams)
        if len(compressed) < chunk.size:
            self._stored.append(compressed)
            self._chunks.append([chunk.size, len(compressed), COMPRESSED])
        else:
            self._stored.append(chunk.tobytes())
            self._chunks.append([chunk.size, chunk.size, STORED_RAW])

    def finish(self) -> tuple[np.ndarray, list[list[int]], float | None]:
        """``(blob, chunks, update_ratio)``: all chunks concatenated, the chunk table
        ``[[raw_len, stored_len, flag], ...]`` (flag 0 compressed, 1 stored raw), and for
        a delta of a float tensor ``||x - base|| / ||base||`` (None otherwise, when the
        base is all zeros, or when either holds NaN or inf). The blob is read-only."""
        self._finished = True
        blob = np.frombuffer(b"".join(self._stored), np.uint8)
        self._stored = []
        self._residual_buf = np.empty(0, np.uint8)
        ratio = self._norms.ratio() if self._norms is not None else None
        return blob, self._chunks, ratio


def check_chunks(chunks, raw_nbytes: int, stored_nbytes: int, itemsize: int) -> None:
    """Raise ValueError unless ``chunks`` is a well-formed chunk table for a tensor of
    ``raw_nbytes`` bytes, encoded as a blob of ``stored_nbytes`` bytes."""
    if not isinstance(chunks, (list, tuple)):
        raise ValueError(f"chunk table must be a list, got {type(chunks).__name__}")
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
        if flag not in (COMPRESSED, STORED_RAW):
            raise ValueError(f"chunk {i}: flag must be 0 (compressed) or 1 (stored raw), got {flag}")
        if raw_len > CHUNK_BYTES:
            raise ValueError(f"chunk {i}: raw_len {raw_len} exceeds the chunk size {CHUNK_BYTES}")
        if raw_len % itemsize:
            raise ValueError(f"chunk {i}: raw_len {raw_len} is not a multiple of the "
                             f"element size {itemsize}")
        if flag == STORED_RAW and stored_len != raw_len:
            raise ValueError(f"chunk {i}: stored raw but stored_len {stored_len} != raw_len {raw_len}")
        if flag == COMPRESSED and not (blosc2.MIN_HEADER_LENGTH <= stored_len
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
           base: np.ndarray | None = None, base2: np.ndarray | None = None) -> None:
    """Decode ``blob`` into ``out`` (``sum(raw_len)`` bytes), adding back the prediction
    from ``base`` (and ``base2``) for a delta. Raises ValueError on any inconsistency."""
    _check_byte_array("blob", blob)
    _check_byte_array("out", out, writeable=True)
    if base2 is not None and base is None:
        raise ValueError("a second base without a first")
    _check_bases(base, base2, out.size, "the tensor")
    residuals = _Residuals(itemsize)
    check_chunks(chunks, out.size, blob.size, itemsize)
    src = dst = 0
    for i, (raw_len, stored_len, flag) in enumerate(chunks):
        stored = blob[src:src + stored_len]
        target = out[dst:dst + raw_len]
        if flag == STORED_RAW:
            np.copyto(target, stored)
        else:
            # The header's sizes must match the table before blosc2 acts on them.
            nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(stored)
            if nbytes != raw_len or cbytes != stored_len:
                raise ValueError(f"chunk {i}: its header says {nbytes} bytes compressed to "
                                 f"{cbytes}, the chunk table {raw_len} to {stored_len}")
            try:
                blosc2.decompress2(stored, dst=target, nthreads=1)
            except (RuntimeError, ValueError) as e:
                raise ValueError(f"chunk {i} does not decompress: {e}") from None
        if base is not None:
            residuals.decode(target, base[dst:dst + raw_len],
                             None if base2 is None else base2[dst:dst + raw_len])
        src += stored_len
        dst += raw_len


def check_keep_bits(dtype: str, keep_bits: int) -> None:
    """Raise ValueError unless ``keep_bits`` mantissa bits can be kept for ``dtype``."""
    if dtype not in _MANTISSA_BITS:
        raise ValueError(f"mantissa rounding applies to {', '.join(LOSSY_DTYPES)}, not {dtype}")
    top = _MANTISSA_BITS[dtype]
    if isinstance(keep_bits, np.integer):
        keep_bits = int(keep_bits)
    if isinstance(keep_bits, bool) or not isinstance(keep_bits, int) or not 1 <= keep_bits <= top:
        raise ValueError(f"keep_bits must be 1..{top} for {dtype}, got {keep_bits!r}")


def rounding_bound(dtype: str, keep_bits: int) -> float:
    """The largest relative error :func:`round_mantissa` makes on normal numbers."""
    check_keep_bits(dtype, keep_bits)
    return 2.0 ** -(keep_bits + 1)


def round_mantissa(array: np.ndarray, dtype: str, keep_bits: int) -> np.ndarray:
    """A copy of ``array`` (a ``dtype`` tensor's stored values: bfloat16 and float16 as
    uint16 bit patterns) rounded to ``keep_bits`` explicit mantissa bits, to nearest with
    ties to even. NaN and inf are unchanged; a finite value never rounds to inf (it is
    truncated instead)."""
    check_keep_bits(dtype, keep_bits)
    bits_type = _BITS_TYPE[dtype]
    storage = np.dtype(np.uint16 if dtype in ("bfloat16", "float16") else dtype)
    if not isinstance(array, np.ndarray) or array.dtype != storage:
        got = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
        raise ValueError(f"{dtype} values must be given as a {storage} array, got {got}")
    bits = array.view(bits_type)
    drop = _MANTISSA_BITS[dtype] - keep_bits
    if drop == 0:
        return array.copy()
    width = 8 * bits.itemsize
    one = bits_type(1)
    mantissa_bits = _MANTISSA_BITS[dtype]
    exponent_mask = bits_type(((1 << (width - 1 - mantissa_bits)) - 1) << mantissa_bits)
    keep_mask = bits_type(~((1 << drop) - 1) & ((1 << width) - 1))
    # Adding half an ulp minus one, plus the lowest kept bit, rounds ties to even;
    # a carry out of the mantissa correctly bumps the exponent.
    lowest_kept = np.right_shift(bits, bits_type(drop)) & one
    rounded = bits + bits_type((1 << (drop - 1)) - 1)
    rounded += lowest_kept
    rounded &= keep_mask
    special = (bits & exponent_mask) == exponent_mask          # NaN and inf
    overflowed = (rounded & exponent_mask) == exponent_mask    # finite rounded up to inf
    result = np.where(special, bits, np.where(overflowed, bits & keep_mask, rounded))
    return result.astype(bits_type, copy=False).view(storage).reshape(array.shape)
