"""Opt-in lossy storage of trajectory points: floats rounded to fewer mantissa bits.

:func:`round_mantissa` rounds floats to ``keep_bits`` explicit mantissa bits (round to
nearest, ties to even), which makes the low bits zero and the residuals that
:mod:`.codecs` encodes far more compressible. :class:`MantissaSplit` keeps the bits
rounding drops beside the rounded value, encoded alone, while the step is still a restore
point; :func:`add_low_bits` puts them back.
"""

from __future__ import annotations

import numpy as np

from .codecs import BITS_TYPE, LOSSY_DTYPES, MANTISSA_BITS, Encoder, check_byte_array, decode
from .digest import checksum_stream


def check_keep_bits(dtype: str, keep_bits: int) -> None:
    """Raise ValueError unless ``keep_bits`` mantissa bits can be kept for ``dtype``."""
    if dtype not in MANTISSA_BITS:
        raise ValueError(f"mantissa rounding applies to {', '.join(LOSSY_DTYPES)}, not {dtype}")
    top = MANTISSA_BITS[dtype]
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
    storage = np.dtype(np.uint16 if dtype in ("bfloat16", "float16") else dtype)
    if not isinstance(array, np.ndarray) or array.dtype != storage:
        got = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
        raise ValueError(f"{dtype} values must be given as a {storage} array, got {got}")
    bits = np.ascontiguousarray(array).reshape(-1).view(BITS_TYPE[dtype])
    out = np.empty_like(bits)
    _Rounder(dtype, keep_bits).round_into(bits, out)
    return out.view(storage).reshape(array.shape)


class _Rounder:
    """:func:`round_mantissa` of 1-D bit patterns into a given array, block by block in
    scratch allocated on first use, at most one block (in place, numpy's integer ufuncs
    release the GIL): one is made per rounded tensor and step, however small."""

    BLOCK = 1 << 16  # elements per pass: the passes over a block stay in the CPU cache

    def __init__(self, dtype: str, keep_bits: int):
        t = self.bits_type = BITS_TYPE[dtype]
        width, mantissa = 8 * np.dtype(t).itemsize, MANTISSA_BITS[dtype]
        self.drop = t(mantissa - keep_bits)
        self.exponent_mask = t(((1 << (width - 1 - mantissa)) - 1) << mantissa)
        self.keep_mask = t(~((1 << int(self.drop)) - 1) & ((1 << width) - 1))
        self.half_minus_one = t((1 << int(self.drop)) >> 1) - t(1) if self.drop else t(0)
        self.release()

    def release(self) -> None:
        """Let the scratch go (the next :meth:`round_into` allocates it again)."""
        self._scratch = np.empty(0, self.bits_type)
        self._special, self._overflowed = np.empty(0, bool), np.empty(0, bool)

    def round_into(self, bits: np.ndarray, out: np.ndarray) -> None:
        if not self.drop:
            np.copyto(out, bits)
            return
        one = self.bits_type(1)
        if self._scratch.size < min(bits.size, self.BLOCK):
            n = min(bits.size, self.BLOCK)
            self._scratch, self._special, self._overflowed = (
                np.empty(n, self.bits_type), np.empty(n, bool), np.empty(n, bool))
        for at in range(0, bits.size, self.BLOCK):
            b, o = bits[at:at + self.BLOCK], out[at:at + self.BLOCK]
            scratch, special, overflowed = (a[:b.size] for a in (self._scratch, self._special, self._overflowed))
            np.bitwise_and(b, self.exponent_mask, out=scratch)
            np.equal(scratch, self.exponent_mask, out=special)  # NaN and inf: kept as they are
            # Adding half an ulp minus one, plus the lowest kept bit, rounds ties to even;
            # a carry out of the mantissa correctly bumps the exponent.
            np.right_shift(b, self.drop, out=scratch)
            np.bitwise_and(scratch, one, out=scratch)
            np.add(b, self.half_minus_one, out=o)
            np.add(o, scratch, out=o)
            np.bitwise_and(o, self.keep_mask, out=o)
            np.bitwise_and(o, self.exponent_mask, out=scratch)
            np.equal(scratch, self.exponent_mask, out=overflowed)  # a finite value rounded up to inf
            if overflowed.any():
                np.copyto(o, b & self.keep_mask, where=overflowed & ~special)  # truncated instead
            if special.any():
                np.copyto(o, b, where=special)


def mantissa_bits(dtype: str) -> int | None:
    """The explicit mantissa bits of float ``dtype``; None for a dtype never rounded."""
    return MANTISSA_BITS.get(dtype)


class MantissaSplit:
    """Splits a float tensor, piece by piece, into its value rounded to ``keep_bits``
    mantissa bits (:func:`round_mantissa`), which the caller stores, and its *low bits*
    ``bits(exact) XOR bits(rounded)``, compressed alone here (no delta: they are noise).
    ``exact = rounded XOR low`` gives every bit back; :meth:`checksum` is the xxh3-64 of
    the rounded bytes, what a reader of the rounded value gets back."""

    def __init__(self, dtype: str, keep_bits: int):
        check_keep_bits(dtype, keep_bits)
        self.dtype, self.keep_bits = dtype, keep_bits
        self._storage = np.dtype(np.uint16 if dtype in ("bfloat16", "float16") else dtype)
        self.low = Encoder(dtype, delta=False)
        self._hasher = checksum_stream()
        self._rounder = _Rounder(dtype, keep_bits)
        self._rounded_buf = self._low_buf = np.empty(0, np.uint8)

    def add(self, piece: np.ndarray) -> np.ndarray:
        """The rounded bytes of ``piece`` (1-D uint8, whole elements), valid until the next
        call; its low bits are encoded. ``piece`` is not modified."""
        check_byte_array("piece", piece)
        if piece.size % self.low.itemsize:
            raise ValueError(f"piece of {piece.size} bytes is not a whole number of "
                             f"{self.low.itemsize}-byte {self.dtype} elements")
        if self._low_buf.size < piece.size:
            self._rounded_buf, self._low_buf = np.empty(piece.size, np.uint8), np.empty(piece.size, np.uint8)
        rounded, low = self._rounded_buf[:piece.size], self._low_buf[:piece.size]
        bits_type = self._rounder.bits_type
        self._rounder.round_into(piece.view(bits_type), rounded.view(bits_type))
        self._hasher.update(rounded)
        np.bitwise_xor(piece, rounded, out=low)
        self.low.add(low, None)
        return rounded

    def checksum(self) -> str:
        return self._hasher.hexdigest()

    def finish(self) -> tuple[np.ndarray, list[list[int]]]:
        """``(blob, chunks)`` of the low bits (as :meth:`Encoder.finish`)."""
        blob, chunks, _ = self.low.finish()
        self._rounded_buf = self._low_buf = np.empty(0, np.uint8)
        self._rounder.release()
        return blob, chunks


def add_low_bits(rounded: np.ndarray, blob: np.ndarray, chunks: list[list[int]], itemsize: int) -> np.ndarray:
    """The exact bytes (a new 1-D uint8 array) of a value stored as ``rounded`` (not
    modified) and its low bits encoded as ``blob``/``chunks``. Raises ValueError on any
    inconsistency of the blob (as :func:`decode`)."""
    exact = np.empty(rounded.size, np.uint8)
    decode(blob, chunks, itemsize, exact)
    np.bitwise_xor(exact, rounded, out=exact)
    return exact
