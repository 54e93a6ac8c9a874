"""datastates_hist.codecs: lossless round trips, crafted chunk tables, update ratios,
mantissa rounding, and that encoding releases the GIL; on real blosc2 and trained weights."""

import sys
import threading
import time

import blosc2
import numpy as np
import pytest
import torch

from datastates_hist import codecs, rounding
from datastates_hist.codecs import CHUNK_BYTES, STORED_RAW, Encoder, check_chunks, decode
from datastates_hist.dtypes import torch_dtype


def _adam_weights(steps: int, n_in: int = 256, n_out: int = 512, seed: int = 0):
    """(previous, current) float32 weights of an nn.Linear after ``steps`` Adam steps."""
    torch.manual_seed(seed)
    layer = torch.nn.Linear(n_in, n_out)
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-3)
    x, target = torch.randn(64, n_in), torch.randn(64, n_out)
    previous = None
    for _ in range(steps):
        previous = layer.weight.detach().clone()
        loss = torch.nn.functional.mse_loss(layer(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return previous.reshape(-1), layer.weight.detach().clone().reshape(-1)


PREVIOUS, CURRENT = _adam_weights(5)


def _stored(tensor: torch.Tensor, dtype: str) -> np.ndarray:
    """The stored bytes of ``tensor`` converted to ``dtype`` (bfloat16/float16 as uint16)."""
    if dtype == "int64":
        converted = (tensor * 1e6).round().to(torch.int64)
    elif dtype == "uint8":
        converted = ((tensor + 0.1) * 1000).clamp(0, 255).to(torch.uint8)
    elif dtype == "bool":
        converted = tensor > 0
    else:
        converted = tensor.to(getattr(torch, dtype))
    if converted.dtype in (torch.bfloat16, torch.float16):
        converted = converted.view(torch.int16)
    elif converted.dtype == torch.bool:
        converted = converted.view(torch.uint8)
    return converted.numpy().reshape(-1).view(np.uint8).copy()


def _encode(data: np.ndarray, dtype: str, base: np.ndarray | None, piece_elements):
    """Encode ``data`` in pieces of the given element counts (the rest as the last piece)."""
    itemsize = torch_dtype(dtype).itemsize
    encoder = Encoder(dtype, delta=base is not None)
    start = 0
    for count in list(piece_elements) + [None]:
        stop = data.size if count is None else min(data.size, start + count * itemsize)
        encoder.add(data[start:stop], None if base is None else base[start:stop])
        start = stop
    return encoder.finish()


def _decoded(blob, chunks, dtype, nbytes, base=None):
    out = np.empty(nbytes, np.uint8)
    decode(blob, chunks, torch_dtype(dtype).itemsize, out, base, dtype=dtype)
    return out


DTYPES = ["float32", "float64", "bfloat16", "float16", "int64", "uint8", "bool"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("delta", [False, True])
def test_round_trip_is_bit_exact_for_every_storage_dtype(dtype, delta):
    data, base = _stored(CURRENT, dtype), _stored(PREVIOUS, dtype)
    data_before, base_before = data.copy(), base.copy()
    blob, chunks, _ = _encode(data, dtype, base if delta else None, [1, 7, 1001, 0, 12345])
    # Odd piece sizes give one chunk each (the empty piece none).
    assert [c[0] for c in chunks] == [n * data.size // CURRENT.numel()
                                      for n in (1, 7, 1001, 12345, CURRENT.numel() - 13354)]
    assert np.array_equal(data, data_before) and np.array_equal(base, base_before)
    assert np.array_equal(_decoded(blob, chunks, dtype, data.size, base if delta else None), data)
    if dtype in ("float32", "float64", "int64"):
        assert blob.size < data.size  # trained weights do compress


def test_delta_of_consecutive_adam_steps_compresses_better_than_the_step_alone():
    data, base = _stored(CURRENT, "float32"), _stored(PREVIOUS, "float32")
    key, _, _ = _encode(data, "float32", None, [])
    delta, _, _ = _encode(data, "float32", base, [])
    assert delta.size < 0.9 * key.size


def test_a_tensor_larger_than_a_chunk_is_cut_into_chunks_within_each_piece():
    data = np.tile(_stored(CURRENT, "float32"), 12)  # 6 MiB
    base = np.tile(_stored(PREVIOUS, "float32"), 12)
    first = CHUNK_BYTES + 12
    for delta_base in (None, base):
        blob, chunks, _ = _encode(data, "float32", delta_base, [first // 4])
        assert [c[0] for c in chunks] == [CHUNK_BYTES, 12, data.size - first]
        # 12 bytes do not shrink; a delta's chunks are grouped (flag 4)
        assert [c[2] for c in chunks] == ([0, 1, 0] if delta_base is None else [4, 5, 4])
        assert np.array_equal(_decoded(blob, chunks, "float32", data.size, delta_base), data)


def test_an_empty_tensor_has_no_chunks_and_decodes():
    empty = np.empty(0, np.uint8)
    for base in (None, empty):
        encoder = Encoder("float32", delta=base is not None)
        encoder.add(empty, base)
        blob, chunks, ratio = encoder.finish()
        assert (blob.size, chunks, ratio) == (0, [], None)
        decode(blob, chunks, 4, np.empty(0, np.uint8), base, dtype="float32")
    blob, chunks, ratio = Encoder("int64", delta=False).finish()
    assert (blob.size, chunks, ratio) == (0, [], None)


@pytest.mark.parametrize("dtype", ["float32", "int64", "uint8"])
def test_one_element_round_trips(dtype):
    data, base = _stored(CURRENT[:1], dtype), _stored(PREVIOUS[:1], dtype)
    for delta_base in (None, base):
        blob, chunks, _ = _encode(data, dtype, delta_base, [])
        grouped = codecs.GROUPED if delta_base is not None and dtype == "float32" else 0
        assert chunks == [[data.size, data.size, 1 | grouped]]  # too small to shrink: stored raw
        assert np.array_equal(_decoded(blob, chunks, dtype, data.size, delta_base), data)


def test_incompressible_bytes_are_stored_raw():
    data = np.random.default_rng(0).integers(0, 256, CHUNK_BYTES + 1000, dtype=np.uint8)
    blob, chunks, _ = _encode(data, "uint8", None, [])
    assert chunks == [[CHUNK_BYTES, CHUNK_BYTES, 1], [1000, 1000, 1]]
    assert blob.size == data.size
    assert np.array_equal(_decoded(blob, chunks, "uint8", data.size), data)
    base = np.random.default_rng(1).integers(0, 256, data.size, dtype=np.uint8)
    blob, chunks, _ = _encode(data, "uint8", base, [])
    assert [c[2] for c in chunks] == [1, 1] and blob.size == data.size
    assert np.array_equal(_decoded(blob, chunks, "uint8", data.size, base), data)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
def test_update_ratio_is_the_relative_norm_of_the_update(dtype):
    x, base = CURRENT.to(getattr(torch, dtype)), PREVIOUS.to(getattr(torch, dtype))
    _, _, ratio = _encode(_stored(CURRENT, dtype), dtype, _stored(PREVIOUS, dtype), [999])
    x64, base64 = x.to(torch.float64), base.to(torch.float64)
    expected = float(torch.linalg.norm(x64 - base64) / torch.linalg.norm(base64))
    assert ratio == pytest.approx(expected, rel=1e-5)
    assert 0 < ratio < 0.1


def test_update_ratio_over_several_chunks_matches_torch():
    x, base = CURRENT.repeat(12), PREVIOUS.repeat(12)
    _, _, ratio = _encode(_stored(x, "float32"), "float32", _stored(base, "float32"), [])
    # Exact to float64; torch's float32 norm of 1.5M elements is itself off by 3e-5.
    x, base = x.to(torch.float64), base.to(torch.float64)
    expected = float(torch.linalg.norm(x - base) / torch.linalg.norm(base))
    assert ratio == pytest.approx(expected, rel=1e-5)


def test_update_ratio_is_none_without_delta_for_integers_and_for_a_zero_or_nan_base():
    data = _stored(CURRENT, "float32")
    assert _encode(data, "float32", None, [])[2] is None
    assert _encode(_stored(CURRENT, "int64"), "int64", _stored(PREVIOUS, "int64"), [])[2] is None
    assert _encode(data, "float32", np.zeros_like(data), [])[2] is None
    nan_base = _stored(torch.full((4,), float("nan")), "float32")
    assert _encode(data[:16], "float32", nan_base, [])[2] is None


def test_an_encoder_told_to_skip_the_ratio_stores_the_same_bytes_and_no_ratio():
    data, base = _stored(CURRENT, "float32"), _stored(PREVIOUS, "float32")
    encoder = Encoder("float32", delta=True)
    encoder.skip_ratio()
    encoder.add(data, base)
    blob, chunks, ratio = encoder.finish()
    expected, expected_chunks, _ = _encode(data, "float32", base, [])
    assert ratio is None and np.array_equal(blob, expected) and chunks == expected_chunks
    with pytest.raises(RuntimeError, match="^Encoder.skip_ratio called after add$"):
        encoder.skip_ratio()


def test_encoder_rejects_bad_pieces():
    encoder = Encoder("float32", delta=True)
    piece = np.zeros(8, np.uint8)
    with pytest.raises(ValueError, match="^piece of 6 bytes is not a whole number of 4-byte "
                                         "float32 elements$"):
        encoder.add(piece[:6], piece[:6])
    with pytest.raises(ValueError, match="^a delta encoder needs the base's bytes for every piece$"):
        encoder.add(piece, None)
    with pytest.raises(ValueError, match="^base has 4 bytes, the piece 8$"):
        encoder.add(piece, piece[:4])
    with pytest.raises(ValueError, match="^piece must be a 1-D uint8 numpy array$"):
        encoder.add(piece.view(np.float32), piece)
    with pytest.raises(ValueError, match="^base given to an encoder without delta$"):
        Encoder("float32", delta=False).add(piece, piece)
    with pytest.raises(TypeError, match="unknown stored dtype 'float12'"):
        Encoder("float12", delta=False)
    encoder.finish()
    with pytest.raises(RuntimeError, match="^Encoder.add called after finish$"):
        encoder.add(piece, piece)


@pytest.fixture(scope="module")
def encoded():
    """A float32 tensor of two compressed chunks, encoded without delta."""
    data = np.tile(_stored(CURRENT, "float32"), 12)[: CHUNK_BYTES + 4000]
    blob, chunks, _ = _encode(data, "float32", None, [])
    assert [c[2] for c in chunks] == [0, 0]
    return data, blob, chunks


@pytest.mark.parametrize("change, message", [
    (lambda c: "no", "chunk table must be a list, got str"),
    (lambda c: [c[0][:2], c[1]], r"chunk 0: entry must be 3 integers \[raw_len, stored_len, flag\], "
                                 r"got \[4194304, \d+\]"),
    (lambda c: [c[0], [4000, 1.5, 0]], r"chunk 1: entry must be 3 integers .*got \[4000, 1.5, 0\]"),
    (lambda c: [c[0], [4000, True, 0]], r"chunk 1: entry must be 3 integers"),
    (lambda c: [c[0], "abc"], r"chunk 1: entry must be 3 integers .*got 'abc'"),
    (lambda c: [c[0], [0, c[1][1], 0]], "chunk 1: raw_len must be positive and stored_len "
                                        "non-negative, got 0 and"),
    (lambda c: [c[0], [4000, -1, 0]], "chunk 1: raw_len must be positive and stored_len "
                                      "non-negative, got 4000 and -1"),
    (lambda c: [c[0], [4000, c[1][1], 2]], "chunk 1: flag must be 0 .compressed. or 1 "
                                           ".stored raw., got 2"),
    (lambda c: [[CHUNK_BYTES + 4, c[0][1], 0], [3996, c[1][1], 0]],
     f"chunk 0: raw_len {CHUNK_BYTES + 4} exceeds the chunk size {CHUNK_BYTES}"),
    (lambda c: [[CHUNK_BYTES - 2, c[0][1], 0], [4002, c[1][1], 0]],
     f"chunk 0: raw_len {CHUNK_BYTES - 2} is not a multiple of the element size 4"),
    (lambda c: [c[0], [4000, c[1][1], 1]], r"chunk 1: stored raw but stored_len \d+ != raw_len 4000"),
    (lambda c: [c[0], [4000, 8, 0]], "chunk 1: compressed stored_len 8 is impossible for raw_len 4000"),
    (lambda c: [c[0], [4000, 4100, 0]], "chunk 1: compressed stored_len 4100 is impossible"),
    (lambda c: [c[0]], f"chunk table covers {CHUNK_BYTES} bytes, the tensor has {CHUNK_BYTES + 4000}"),
    (lambda c: [c[0], [4000, c[1][1] - 1, 0]], r"chunk table stores \d+ bytes, the blob has \d+"),
    (lambda c: [[c[0][0], c[0][1] + 1, 0], [4000, c[1][1] - 1, 0]],
     r"chunk 0: its header says 4194304 bytes compressed to \d+, the chunk table 4194304 to \d+"),
])
def test_decode_refuses_a_crafted_chunk_table(encoded, change, message):
    data, blob, chunks = encoded
    out = np.zeros(data.size, np.uint8)
    with pytest.raises(ValueError, match=message):
        decode(blob, change([list(c) for c in chunks]), 4, out)


def test_decode_refuses_a_header_that_disagrees_with_the_table(encoded):
    data, blob, chunks = encoded
    out = np.zeros(data.size, np.uint8)
    with pytest.raises(ValueError, match=r"^chunk 1: its header says 4000 bytes compressed to \d+, "
                                         r"the chunk table 3996 to \d+$"):
        decode(blob, [chunks[0], [3996, chunks[1][1], 0]], 4, out[:-4])
    corrupted = blob.copy()
    corrupted[chunks[0][1] + 4] ^= 1  # the second chunk's uncompressed size
    with pytest.raises(ValueError, match=r"^chunk 1: its header says 4001 bytes compressed to \d+, "
                                         r"the chunk table 4000 to \d+$"):
        decode(corrupted, chunks, 4, out)


def test_decode_refuses_a_corrupted_blob(encoded):
    data, blob, chunks = encoded
    out = np.zeros(data.size, np.uint8)
    corrupted = blob.copy()
    corrupted[32] ^= 0xFF  # past blosc2's 32-byte header: the first block's offset
    with pytest.raises(ValueError, match="^chunk 0 does not decompress: "):
        decode(corrupted, chunks, 4, out)
    decode(blob, chunks, 4, out)
    assert np.array_equal(out, data)


def test_check_chunks_and_decode_refuse_bad_arrays(encoded):
    data, blob, chunks = encoded
    check_chunks(chunks, data.size, blob.size, 4)
    with pytest.raises(ValueError, match="^chunk table covers 4198304 bytes, the tensor has 5$"):
        check_chunks(chunks, 5, blob.size, 4)
    read_only = np.zeros(data.size, np.uint8)
    read_only.setflags(write=False)
    with pytest.raises(ValueError, match="^out must be writeable$"):
        decode(blob, chunks, 4, read_only)
    with pytest.raises(ValueError, match="^blob must be a 1-D uint8 numpy array$"):
        decode(blob.tobytes(), chunks, 4, np.zeros(data.size, np.uint8))
    with pytest.raises(ValueError, match="^base has 3 bytes, the tensor 4198304$"):
        decode(blob, chunks, 4, np.zeros(data.size, np.uint8), np.zeros(3, np.uint8))


# -- mantissa rounding ---------------------------------------------------------------

def _values(stored: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values of stored float32/float64 values or bfloat16/float16 bit patterns."""
    if dtype == "bfloat16":
        return torch.from_numpy(stored.view(np.int16)).view(torch.bfloat16).to(torch.float64).numpy()
    if dtype == "float16":
        return stored.view(np.float16).astype(np.float64)
    return stored.astype(np.float64)


@pytest.mark.parametrize("dtype, keep_bits", [("float32", 1), ("float32", 8), ("float32", 22),
                                              ("bfloat16", 1), ("bfloat16", 3), ("bfloat16", 6),
                                              ("float16", 5), ("float64", 20)])
def test_round_mantissa_stays_within_the_bound(dtype, keep_bits):
    stored = _stored(CURRENT, dtype).view(np.uint16 if dtype in ("bfloat16", "float16") else dtype)
    before = stored.copy()
    rounded = rounding.round_mantissa(stored, dtype, keep_bits)
    assert rounded.dtype == stored.dtype and rounded.shape == stored.shape
    assert np.array_equal(stored, before)
    exact, approx = _values(stored, dtype), _values(rounded, dtype)
    normal = np.abs(exact) >= {"float16": 2.0 ** -14}.get(dtype, 1e-30)
    error = np.abs(approx[normal] - exact[normal]) / np.abs(exact[normal])
    bound = rounding.rounding_bound(dtype, keep_bits)
    assert bound == 2.0 ** -(keep_bits + 1)
    assert error.max() <= bound and error.max() > bound / 4
    # Only keep_bits mantissa bits remain.
    drop = {"float32": 23, "float64": 52, "bfloat16": 7, "float16": 10}[dtype] - keep_bits
    bits = rounded.view(f"uint{8 * rounded.itemsize}")
    assert np.all(bits % (1 << drop) == 0)


def test_round_mantissa_rounds_ties_to_even_and_keeps_nan_inf_and_finite_values():
    ties = np.array([1 + 2 ** -9, 1 + 2 ** -8 + 2 ** -9, -(1 + 2 ** -9), 1 + 2 ** -9 + 2 ** -20],
                    np.float32)
    assert rounding.round_mantissa(ties, "float32", 8).tolist() == [1.0, 1 + 2 ** -7, -1.0,
                                                                  1 + 2 ** -8]
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, np.finfo(np.float32).max], np.float32)
    rounded = rounding.round_mantissa(special, "float32", 4)
    assert np.isnan(rounded[0]) and rounded[1:3].tolist() == [np.inf, -np.inf]
    assert rounded.view(np.uint32)[3:5].tolist() == [0, 0x80000000]
    assert np.isfinite(rounded[5]) and rounded[5] == np.float32((2 - 2 ** -4) * 2.0 ** 127)
    bf16 = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0 + 2 ** -7],
                        dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    rounded = rounding.round_mantissa(bf16, "bfloat16", 3)
    assert rounded[:3].tolist() == bf16[:3].tolist() and _values(rounded, "bfloat16")[3] == 1.0


@pytest.mark.parametrize("dtype, keep_bits, message", [
    ("float32", 0, "keep_bits must be 1..23 for float32, got 0"),
    ("float32", 24, "keep_bits must be 1..23 for float32, got 24"),
    ("float64", 53, "keep_bits must be 1..52 for float64, got 53"),
    ("bfloat16", 8, "keep_bits must be 1..7 for bfloat16, got 8"),
    ("float16", 11, "keep_bits must be 1..10 for float16, got 11"),
    ("float32", 2.5, "keep_bits must be 1..23 for float32, got 2.5"),
    ("float32", True, "keep_bits must be 1..23 for float32, got True"),
    ("float32", np.int64(30), "keep_bits must be 1..23 for float32, got 30"),
    ("float32", "8", "keep_bits must be 1..23 for float32, got '8'"),
    ("int64", 3, "mantissa rounding applies to float32, float64, bfloat16, float16, not int64"),
])
def test_keep_bits_out_of_range_is_refused(dtype, keep_bits, message):
    for call in (lambda: rounding.check_keep_bits(dtype, keep_bits),
                 lambda: rounding.rounding_bound(dtype, keep_bits),
                 lambda: rounding.round_mantissa(np.zeros(2, np.float32), dtype, keep_bits)):
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == message


def test_round_mantissa_refuses_values_of_another_dtype():
    with pytest.raises(ValueError, match="^bfloat16 values must be given as a uint16 array, "
                                         "got float32$"):
        rounding.round_mantissa(np.zeros(2, np.float32), "bfloat16", 3)
    assert rounding.round_mantissa(np.ones(2, np.float32), "float32", 23).tolist() == [1.0, 1.0]


# -- the GIL -------------------------------------------------------------------------

def test_encoding_and_decoding_release_the_gil(monkeypatch):
    """Each compression, decompression, residual and grouping pass of add() and decode() lets
    another thread run. With a switch interval longer than the test, a spinner thread runs only
    while the main thread has released the GIL (it gives it back at every iteration, in
    time.sleep(0)), so a call across which its counter moved released it: a test of the
    GIL, not of timing, however busy the machine. blosc2's compression held the GIL unless
    told not to; a bytes.count over 256 MiB holds it, and the spinner never runs in it."""
    data = np.tile(_stored(CURRENT, "float32"), 128)
    base = np.tile(_stored(PREVIOUS, "float32"), 128)
    assert data.size == 64 << 20
    count, stop = [0], [False]
    ran = {}  # name -> [calls, calls across which the spinner ran]

    def spin():
        while not stop[0]:
            count[0] += 1
            time.sleep(0)

    def watch(owner, name):
        function = getattr(owner, name)

        def watched(*args, **kwargs):
            before = count[0]
            result = function(*args, **kwargs)
            calls = ran.setdefault(name, [0, 0])
            calls[0] += 1
            calls[1] += count[0] != before
            return result
        monkeypatch.setattr(owner, name, watched)

    for owner, name in ((blosc2, "compress2"), (blosc2, "decompress2"), (codecs._fused, "residual"),
                        (codecs._fused, "group"), (codecs._fused, "unresidual")):
        if owner is not None:
            watch(owner, name)
    held = bytes(256 << 20)

    def count_in_held():
        return held.count(b"\x01\x02\x03\x04\x05\x06\x07\x08\x09")

    encoded, out = {}, np.empty_like(data)
    spinner = threading.Thread(target=spin, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    spinner.start()
    try:
        for delta in (False, True):
            encoder = Encoder("float32", delta=delta)
            encoder.add(data, base if delta else None)
            encoded[delta] = encoder.finish()
            blob, chunks, _ = encoded[delta]
            decode(blob, chunks, 4, out, base if delta else None, dtype="float32")
            assert np.array_equal(out, data)
        before = count[0]
        count_in_held()
        held_ran = count[0] != before
    finally:
        stop[0] = True
        spinner.join()
        sys.setswitchinterval(interval)
    assert not held_ran  # the spinner cannot run while the GIL is held
    expected = {"compress2", "decompress2"} | ({"residual", "group", "unresidual"} if codecs._fused else set())
    assert set(ran) == expected, ran
    # 16 calls of each kernel, 32 of compression and decompression. A function
    # that holds the GIL never lets the spinner run; one that releases it may still miss
    # it in a short call on a busy machine (7 calls of 16 with two processes spinning
    # beside the test on two cores), never in all of them.
    assert all(across > 0 for calls, across in ran.values()), ran


@pytest.mark.parametrize("dtype, np_type", [("float32", np.uint32), ("int64", np.uint64), ("bfloat16", np.uint16),
                                            ("uint8", np.uint8)])
def test_the_residual_is_the_zigzag_of_the_difference_from_the_extrapolation(dtype, np_type):
    """docs/format.md section 6, on numbers small enough to check by hand."""
    width = np.dtype(np_type).itemsize * 8
    x = np.array([5, 3, 0, 2 ** width - 1, 7], np_type)
    b1 = np.array([3, 3, 1, 0, 7], np_type)
    b2 = np.array([2, 5, 3, 0, 9], np_type)
    # prediction 2*b1 - b2 = [4, 1, 2**w - 1, 0, 5]; difference x - p = [1, 2, 1, -1, 2]
    expected = np.array([2, 4, 2, 1, 4], np_type)  # zigzag: 2d for d >= 0, -2d - 1 for d < 0
    encoder = Encoder(dtype, delta=True)
    encoder.add(x.view(np.uint8), b1.view(np.uint8), b2.view(np.uint8))
    blob, chunks, _ = encoder.finish()
    assert len(chunks) == 1  # grouped for floats: b1's exponents are all 0, so in the same order
    residual = np.empty(x.nbytes, np.uint8)
    if chunks[0][2] & STORED_RAW:
        residual[:] = blob
    else:
        blosc2.decompress2(blob.tobytes(), dst=residual)
    assert residual.view(np_type).tolist() == expected.tolist()
    out = np.empty(x.nbytes, np.uint8)
    decode(blob, chunks, x.itemsize, out, b1.view(np.uint8), b2.view(np.uint8), dtype=dtype)
    assert out.view(np_type).tolist() == x.tolist()


# the biased exponent of each float dtype's bit pattern (docs/format.md section 6), as (shift, bits)
EXPONENT_FIELDS = {"float32": (23, 8), "float64": (52, 11), "bfloat16": (7, 8), "float16": (10, 5)}


@pytest.mark.parametrize("dtype", sorted(EXPONENT_FIELDS))
def test_a_float_delta_is_stored_grouped_by_the_exponent_of_its_base(dtype):
    """docs/format.md section 6, grouped chunks: the stored residual is the zigzag residual
    in a stable order by the biased exponent of x1's element; it decodes back exactly."""
    previous, current = _stored(PREVIOUS, dtype), _stored(CURRENT, dtype)
    unsigned = {2: np.uint16, 4: np.uint32, 8: np.uint64}[torch_dtype(dtype).itemsize]
    stored = {}
    for grouped in (True, False):
        encoder = Encoder(dtype, delta=True, grouped=grouped)
        encoder.add(current, previous)
        blob, chunks, _ = encoder.finish()
        assert [c[2] for c in chunks] == [codecs.GROUPED if grouped else 0]
        residual = np.empty(current.size, np.uint8)
        blosc2.decompress2(blob.tobytes(), dst=residual)
        stored[grouped] = residual.view(unsigned), blob.size
        out = np.empty(current.size, np.uint8)
        decode(blob, chunks, torch_dtype(dtype).itemsize, out, previous, dtype=dtype)  # an ungrouped one: version 4
        assert np.array_equal(out, current)
    shift, bits = EXPONENT_FIELDS[dtype]
    exponents = (previous.view(unsigned) >> unsigned(shift)) & unsigned((1 << bits) - 1)
    assert len(np.unique(exponents)) > 3  # the order is not trivial
    order = np.argsort(exponents, kind="stable")
    assert np.array_equal(stored[True][0], stored[False][0][order])
    if dtype in ("float32", "float64"):  # Adam's weights: grouped is smaller
        assert stored[True][1] < stored[False][1], (stored[True][1], stored[False][1])


def test_a_grouped_chunk_is_split_per_element_byte_and_a_reader_follows_either_split_mode():
    """docs/format.md: a writer MAY choose the split mode (the Blosc2 header records it);
    datastates-hist splits a grouped chunk into one stream per element byte, except a
    rounded tensor's (whose zero low bit planes compress better in one stream), and a chunk
    written either way decodes the same."""
    dont_split = 0x10  # the Blosc2 header's flags byte (offset 2)
    previous, current = _stored(PREVIOUS, "float32"), _stored(CURRENT, "float32")
    rounded = [rounding.round_mantissa(a.view(np.float32), "float32", 8).view(np.uint8) for a in (previous, current)]
    for (base, x), drop, split in [((previous, current), 0, True), (rounded, 15, False)]:
        encoder = Encoder("float32", delta=True, drop=drop)
        encoder.add(x, base)
        blob, chunks, _ = encoder.finish()
        assert [c[2] for c in chunks] == [codecs.GROUPED]
        assert bool(blob[2] & dont_split) is not split
        residual = np.empty(x.size, np.uint8)
        blosc2.decompress2(blob.tobytes(), dst=residual)
        other = blosc2.SplitMode.NEVER_SPLIT if split else blosc2.SplitMode.ALWAYS_SPLIT
        again = np.frombuffer(blosc2.compress2(residual, **{**codecs._cparams(4, True), "splitmode": other}), np.uint8)
        assert bool(again[2] & dont_split) is split
        for stored in (blob, again):
            out = np.empty(x.size, np.uint8)
            decode(stored, [[x.size, stored.size, codecs.GROUPED]], 4, out, base, dtype="float32")
            assert np.array_equal(out, x)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
@pytest.mark.parametrize("delta", [False, True])
def test_pieces_added_without_compress_are_stored_raw_and_decode_with_the_others(dtype, delta):
    """A piece added with ``compress=False`` (the flush giving way to training) is stored as
    raw chunks: a delta's its residual, ungrouped; the tensor decodes bit-exact, and the
    same anchor copy and update ratio come out."""
    current, previous = _stored(CURRENT, dtype), _stored(PREVIOUS, dtype)
    older = _stored(PREVIOUS * 0.999, dtype)
    half = current.size // 2 // torch_dtype(dtype).itemsize * torch_dtype(dtype).itemsize
    results = {}
    for compress in ((True, True), (True, False), (False, True)):
        encoder = Encoder(dtype, delta=delta)
        keep = np.zeros(current.size, np.uint8)
        for part, squeeze in zip((slice(0, half), slice(half, None)), compress):
            encoder.add(current[part], *((previous[part], older[part]) if delta else (None, None)),
                        keep=keep[part], compress=squeeze)
        blob, chunks, ratio = encoder.finish()
        assert np.array_equal(keep, current)
        for (raw_len, stored_len, flag), squeeze in zip(chunks, compress):
            if not squeeze:
                assert flag == STORED_RAW and stored_len == raw_len, chunks
        out = np.empty(current.size, np.uint8)
        decode(blob, chunks, torch_dtype(dtype).itemsize, out, *((previous, older) if delta else ()), dtype=dtype)
        assert np.array_equal(out, current)
        results[compress] = blob.size, ratio
    assert results[(True, False)][0] > results[(True, True)][0]
    assert results[(True, False)][1] == results[(False, True)][1] == results[(True, True)][1]


def test_a_delta_against_two_bases_is_grouped_by_the_first_base_not_the_extrapolation():
    """docs/format.md: the key of a delta against x1 and x2 is x1's exponent, not that of
    the prediction 2*x1 - x2 (whose exponents here put the elements in another order)."""
    b1 = np.array([1.0, 2.0, 4.0, 0.5, 8.0, 16.0], np.float32)
    b2 = np.array([0.25, 8.0, 4.0, 0.5, 64.0, 16.0], np.float32)
    x = (b1 * 1.001).astype(np.float32)
    encoder = Encoder("float32", delta=True)
    encoder.add(x.view(np.uint8), b1.view(np.uint8), b2.view(np.uint8))
    blob, chunks, _ = encoder.finish()
    assert chunks[0][2] == codecs.STORED_RAW | codecs.GROUPED  # six elements: stored as they are
    u1, u2, ux = (a.view(np.uint32).astype(np.int64) for a in (b1, b2, x))
    d = (ux - (2 * u1 - u2) + 2**31) % 2**32 - 2**31
    residual = (d << 1) ^ (d >> 63)
    exponent = lambda u: (u >> 23) & 0xFF  # noqa: E731
    assert not np.array_equal(np.argsort(exponent(u1), kind="stable"),
                              np.argsort(exponent((2 * u1 - u2) % 2**32), kind="stable"))
    stored = blob.view(np.uint32).astype(np.int64)
    assert stored.tolist() == residual[np.argsort(exponent(u1), kind="stable")].tolist()
    out = np.empty(x.nbytes, np.uint8)
    decode(blob, chunks, 4, out, b1.view(np.uint8), b2.view(np.uint8), dtype="float32")
    assert np.array_equal(out, x.view(np.uint8))


def test_a_delta_against_a_prediction_decodes_with_the_prediction_made_chunk_by_chunk():
    """decode(predict=...): the reader's way for predicted deltas, one chunk of the
    prediction at a time, gives what decoding against the whole prediction gives."""
    rng = np.random.default_rng(3)
    n = (2 * CHUNK_BYTES + 4096) // 4
    predicted = (rng.standard_normal(n) * 0.02).astype(np.float32)
    x = (predicted + rng.standard_normal(n).astype(np.float32) * 1e-5).astype(np.float32)
    encoder = Encoder("float32", delta=True)
    encoder.add(x.view(np.uint8), predicted.view(np.uint8))
    blob, chunks, _ = encoder.finish()
    assert len(chunks) == 3
    asked = []

    def predict(start, stop, into):
        asked.append((start, stop, into.size))
        into[:] = predicted.view(np.uint8)[start:stop]

    out = np.empty(x.nbytes, np.uint8)
    decode(blob, chunks, 4, out, dtype="float32", predict=predict)
    assert np.array_equal(out, x.view(np.uint8))
    bounds = np.cumsum([0] + [raw for raw, _, _ in chunks]).tolist()
    assert asked == [(a, b, b - a) for a, b in zip(bounds, bounds[1:])]
    with pytest.raises(ValueError, match=r"^a delta against a base or a prediction, not both$"):
        decode(blob, chunks, 4, out, predicted.view(np.uint8), dtype="float32", predict=predict)


@pytest.mark.parametrize("grouped", [True, False])
def test_an_encoder_asks_for_the_prediction_chunk_by_chunk_and_stores_what_the_whole_prediction_gives(grouped):
    """Encoder.add(predict=...), the writer's way: the prediction of each chunk of the
    piece, asked for in order, gives the same bytes as encoding against the whole of it."""
    rng = np.random.default_rng(4)
    n = (2 * CHUNK_BYTES + 4096) // 4
    predicted = (rng.standard_normal(n) * 0.02).astype(np.float32)
    x = (predicted + rng.standard_normal(n).astype(np.float32) * 1e-5).astype(np.float32)
    whole = Encoder("float32", delta=True, grouped=grouped)
    whole.add(x.view(np.uint8), predicted.view(np.uint8))
    expected_blob, expected_chunks, _ = whole.finish()
    asked = []

    def predict(start, stop, into):
        asked.append((start, stop, into.size))
        into[:] = predicted.view(np.uint8)[start:stop]

    encoder = Encoder("float32", delta=True, grouped=grouped)
    keep = np.empty(x.nbytes, np.uint8)
    encoder.add(x.view(np.uint8), None, keep=keep, predict=predict)
    blob, chunks, _ = encoder.finish()
    assert chunks == expected_chunks and np.array_equal(blob, expected_blob)
    assert np.array_equal(keep, x.view(np.uint8))
    bounds = [0, CHUNK_BYTES, 2 * CHUNK_BYTES, x.nbytes]
    assert asked == [(a, b, b - a) for a, b in zip(bounds, bounds[1:])]
    with pytest.raises(ValueError, match=r"^a delta against a base or a prediction, not both$"):
        Encoder("float32", delta=True).add(x.view(np.uint8), predicted.view(np.uint8), predict=predict)
    with pytest.raises(ValueError, match=r"^a prediction given to an encoder without delta$"):
        Encoder("float32", delta=False).add(x.view(np.uint8), None, predict=predict)


def test_a_grouped_chunk_is_refused_where_no_float_delta_is():
    previous, current = _stored(PREVIOUS, "float32"), _stored(CURRENT, "float32")
    encoder = Encoder("float32", delta=True)
    encoder.add(current, previous)
    blob, chunks, _ = encoder.finish()
    out = np.empty(current.size, np.uint8)
    for base, dtype in ((previous, None), (previous, "int32"), (None, "float32")):
        with pytest.raises(ValueError, match=r"^chunk 0: flag must be 0 \(compressed\) or 1 \(stored raw\), got 4$"):
            decode(blob, chunks, 4, out, base, dtype=dtype)
    with pytest.raises(ValueError, match=r"^a float64 delta of 4-byte elements$"):
        decode(blob, chunks, 4, out, previous, dtype="float64")


def test_the_grouping_kernel_checks_its_buffers():
    fused = codecs._fused
    if fused is None:
        pytest.skip("the C kernel is not built")
    a, b = np.zeros(16, np.uint8), np.zeros(16, np.uint8)
    for args, message in [((a, a[:8], b, 4, 23, 8, False), "group: the buffers differ in size"),
                          ((a, b, a, 4, 23, 8, False), "group: the destination must not overlap the source or the key"),
                          ((a[:8], b[:8], a[4:12], 4, 23, 8, False),  # a partial overlap
                           "group: the destination must not overlap the source or the key"),
                          ((a, b, b, 4, 23, 8, False), "group: the destination must not overlap the source or the key"),
                          ((a, a, b, 4, 30, 8, False), "group: the key's bits must lie within the element"),
                          ((a, a, b, 4, 2**31 - 1, 1, False), "group: the key's bits must lie within the element"),
                          ((a, a, b, 3, 0, 8, False), "group needs whole elements of 2, 4 or 8 bytes")]:
        with pytest.raises(ValueError, match=f"^{message}$"):
            fused.group(*args)


@pytest.mark.parametrize("dtype", sorted(EXPONENT_FIELDS))
def test_the_grouping_kernel_orders_as_a_stable_sort_at_every_length(dtype):
    """The kernel counts in four interleaved sets of counters: every length, whole sets or
    not, gives numpy's stable order, and the inverse undoes it."""
    fused = codecs._fused
    if fused is None:
        pytest.skip("the C kernel is not built")
    itemsize = torch_dtype(dtype).itemsize
    unsigned = {2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]
    shift, bits = EXPONENT_FIELDS[dtype]
    rng = np.random.default_rng(7)
    for n in [*range(10), 1001, 1002, 1003, 65539]:
        src = rng.integers(0, 256, n * itemsize, dtype=np.uint8)
        # few exponents, in runs: the counters' chains the kernel interleaves
        key = np.repeat(rng.integers(0, 256, n * itemsize // 8 + 1, dtype=np.uint8), 8)[:n * itemsize]
        exponents = (key.view(unsigned) >> unsigned(shift)) & unsigned((1 << bits) - 1)
        expected = src.view(unsigned)[np.argsort(exponents, kind="stable")]
        grouped, back = np.empty_like(src), np.empty_like(src)
        fused.group(src, key, grouped, itemsize, shift, bits, False)
        assert np.array_equal(grouped.view(unsigned), expected), n
        fused.group(grouped, key, back, itemsize, shift, bits, True)
        assert np.array_equal(back, src), n


def _rounded_steps(keep_bits: int, dtype: str = "float32"):
    """Three consecutive Adam steps of a layer's weights, rounded to ``keep_bits`` bits."""
    w = [_stored(x, dtype) for x in (_adam_weights(4)[0], PREVIOUS, CURRENT)]
    storage = np.uint16 if dtype in ("bfloat16", "float16") else np.dtype(dtype)
    return [rounding.round_mantissa(x.view(storage), dtype, keep_bits).view(np.uint8).reshape(-1) for x in w]


@pytest.mark.parametrize("dtype, keep_bits", [("float32", 8), ("float32", 1), ("float64", 20), ("float16", 4)])
def test_a_delta_of_rounded_values_is_shifted_by_the_dropped_bits_and_round_trips(dtype, keep_bits):
    """docs/format.md: the residual of a rounded tensor's delta is stored shifted right by
    the mantissa bits rounding dropped; it is smaller than unshifted, and decodes exactly."""
    b2, b1, x = _rounded_steps(keep_bits, dtype)
    drop = rounding.mantissa_bits(dtype) - keep_bits
    sizes = {}
    for d in (0, drop):
        encoder = Encoder(dtype, delta=True, drop=d, grouped=False)  # a grouped delta is never shifted
        encoder.add(x, b1, b2)
        blob, chunks, _ = encoder.finish()
        assert all(bool(c[2] & codecs.SHIFTED) == bool(d) for c in chunks), chunks
        out = np.empty(x.size, np.uint8)
        decode(blob, chunks, torch_dtype(dtype).itemsize, out, b1, b2, drop=drop, dtype=dtype)
        assert np.array_equal(out, x)
        sizes[d] = blob.size
    assert sizes[drop] < sizes[0], sizes


def test_a_chunk_whose_low_bits_are_not_zero_is_stored_unshifted():
    """A NaN keeps its payload when rounded: its chunk is stored as it is, the others shifted."""
    b2, b1, x = _rounded_steps(8)
    x = np.tile(x, 1 + 2 * CHUNK_BYTES // x.size)[: 2 * CHUNK_BYTES]
    b1 = np.tile(b1, 1 + 2 * CHUNK_BYTES // b1.size)[: 2 * CHUNK_BYTES]
    b2 = np.tile(b2, 1 + 2 * CHUNK_BYTES // b2.size)[: 2 * CHUNK_BYTES]
    x.view(np.uint32)[CHUNK_BYTES // 4 + 3] = 0x7FC00001  # a NaN with a payload in the dropped bits
    encoder = Encoder("float32", delta=True, drop=15, grouped=False)
    encoder.add(x, b1, b2)
    blob, chunks, _ = encoder.finish()
    assert [c[2] & codecs.SHIFTED for c in chunks] == [codecs.SHIFTED, 0]
    out = np.empty(x.size, np.uint8)
    decode(blob, chunks, 4, out, b1, b2, drop=15, dtype="float32")
    assert np.array_equal(out, x)


def test_a_shifted_chunk_is_refused_where_nothing_was_rounded():
    b2, b1, x = _rounded_steps(8)
    encoder = Encoder("float32", delta=True, drop=15, grouped=False)
    encoder.add(x, b1, b2)
    blob, chunks, _ = encoder.finish()
    assert chunks[0][2] == codecs.SHIFTED
    out = np.empty(x.size, np.uint8)
    with pytest.raises(ValueError, match=r"^chunk 0: flag must be 0 \(compressed\) or 1 \(stored raw\), "
                                         r"plus 4 \(grouped\), got 2$"):
        decode(blob, chunks, 4, out, b1, b2, dtype="float32")
    with pytest.raises(ValueError, match=r"^chunk 0: flag must be 0 \(compressed\) or 1 \(stored raw\), got 2$"):
        decode(blob, chunks, 4, out, drop=15)  # a key is never shifted
    with pytest.raises(ValueError, match=r"^chunk 0: flag must be 0 \(compressed\) or 1 \(stored raw\), "
                                         r"plus 2 \(shifted\), plus 4 \(grouped\), got 8$"):
        decode(blob, [[chunks[0][0], chunks[0][1], 8]], 4, out, b1, b2, drop=15, dtype="float32")


def test_a_grouped_delta_of_rounded_values_is_not_shifted_and_round_trips():
    """Bit-shuffled, a grouped residual's zero low bits cost no more than shifted away."""
    b2, b1, x = _rounded_steps(8)
    sizes = {}
    for grouped in (True, False):
        encoder = Encoder("float32", delta=True, drop=15, grouped=grouped)
        encoder.add(x, b1, b2)
        blob, chunks, _ = encoder.finish()
        assert [c[2] for c in chunks] == [codecs.GROUPED if grouped else codecs.SHIFTED]
        out = np.empty(x.size, np.uint8)
        decode(blob, chunks, 4, out, b1, b2, drop=15, dtype="float32")
        assert np.array_equal(out, x)
        sizes[grouped] = blob.size
    assert sizes[True] < sizes[False], sizes


@pytest.mark.parametrize("dtype", DTYPES + ["int32", "complex128"])
@pytest.mark.parametrize("extrapolate", [False, True])
def test_the_kernel_and_numpy_encode_alike_and_keep_the_piece_where_base2_was(dtype, extrapolate, monkeypatch):
    """The C kernel (residual, update ratio, the anchor's copy in one pass) and numpy give
    the same blob and chunk table, the same piece kept, even in base2's own buffer (as an
    anchor reuses its oldest value's), and the same ratio to float32 rounding."""
    fused = codecs._fused
    assert fused is not None  # tools/install.sh builds it
    rng = np.random.default_rng(7)
    older, previous, current = (_stored(w, "float32" if dtype == "complex128" else dtype)
                                for w in (_adam_weights(4)[0], PREVIOUS, CURRENT))
    if dtype == "complex128":  # 16-byte elements: two float64 halves each
        older, previous, current = (np.repeat(x.view(np.float32).astype(np.float64), 2).view(np.uint8)
                                    for x in (older, previous, current))
    current = np.concatenate([current] * 40)  # several chunks
    previous, older = np.concatenate([previous] * 40), np.concatenate([older] * 40)
    current[rng.integers(0, current.size, 50)] ^= 0xFF  # some large residuals too
    results = {}
    for path in ("kernel", "numpy"):
        if path == "numpy":
            monkeypatch.setattr(codecs, "_fused", None)
        base2 = older.copy() if extrapolate else None
        keep = base2 if extrapolate else np.zeros_like(current)
        encoder = Encoder(dtype, delta=True)
        for start in range(0, current.size, 3 * CHUNK_BYTES // 2):  # pieces across chunk bounds
            cut = slice(start, start + 3 * CHUNK_BYTES // 2)
            encoder.add(current[cut], previous[cut], None if base2 is None else base2[cut], keep[cut])
        results[path] = (*encoder.finish(), keep)
    (blob, chunks, ratio, kept), (blob_np, chunks_np, ratio_np, kept_np) = results["kernel"], results["numpy"]
    assert len(chunks) >= 2 and chunks == chunks_np and np.array_equal(blob, blob_np)
    assert np.array_equal(kept, current) and np.array_equal(kept_np, current)
    for path in ("numpy", "kernel"):  # decoded alike: numpy's passes, the kernel's one
        if path == "kernel":
            monkeypatch.setattr(codecs, "_fused", fused)
        out = np.empty(current.size, np.uint8)
        decode(blob, chunks, torch_dtype(dtype).itemsize, out, previous, older if extrapolate else None, dtype=dtype)
        assert np.array_equal(out, current), path
    if dtype in ("float32", "float64", "bfloat16", "float16"):
        assert ratio == pytest.approx(ratio_np, rel=1e-5) and ratio > 0
    else:
        assert ratio is None and ratio_np is None


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("extrapolate", [False, True])
@pytest.mark.parametrize("shift", [0, 3])
def test_the_kernel_and_numpy_turn_residuals_back_alike(itemsize, extrapolate, shift):
    """Any bit patterns, wrapping modulo 2**width: the kernel's one pass equals numpy's."""
    rng = np.random.default_rng(itemsize * 10 + shift)
    z, b1, b2 = (rng.integers(0, 256, 4099 * itemsize, dtype=np.uint8) for _ in range(3))
    b2 = b2 if extrapolate else None
    by_numpy, by_kernel = z.copy(), z.copy()
    codecs._Residuals(itemsize).decode(by_numpy, b1, b2, shift)
    codecs._fused.unresidual(by_kernel, b1, b2, itemsize, shift)
    assert np.array_equal(by_kernel, by_numpy)


def test_the_kernel_refuses_buffers_that_differ_or_partial_elements():
    x = np.zeros(16, np.uint8)
    with pytest.raises(ValueError, match="^residual: the buffers differ in size$"):
        codecs._fused.residual(x, x[:8], None, np.empty(16, np.uint8), None, 4, 1)
    with pytest.raises(ValueError, match="^residual needs whole elements of 1, 2, 4 or 8 bytes$"):
        codecs._fused.residual(x[:6], x[:6], None, np.empty(6, np.uint8), None, 4, 1)
    with pytest.raises(ValueError, match="^residual: norms 1 needs 4-byte elements, 2 8-byte ones$"):
        codecs._fused.residual(x, x, None, np.empty(16, np.uint8), None, 8, 1)
    with pytest.raises(ValueError, match="read-only"):  # out must be writable
        codecs._fused.residual(x, x, None, np.frombuffer(bytes(16), np.uint8), None, 4, 1)
    with pytest.raises(ValueError, match="^unresidual: the buffers differ in size$"):
        codecs._fused.unresidual(x, x, x[:8], 4, 0)
    with pytest.raises(ValueError, match="^unresidual needs whole elements of 1, 2, 4 or 8 bytes$"):
        codecs._fused.unresidual(x[:6], x[:6], None, 4, 0)
    with pytest.raises(ValueError, match="^unresidual: the shift must be less than the element's bits$"):
        codecs._fused.unresidual(x, x, None, 4, 32)
    with pytest.raises(ValueError, match="read-only"):
        codecs._fused.unresidual(np.frombuffer(bytes(16), np.uint8), x, None, 4, 0)


@pytest.mark.parametrize("fused", [True, False])
def test_encoders_of_tiny_tensors_hold_no_block_of_scratch(monkeypatch, fused):
    """An encoder (and a rounded tensor's split) is made per tensor and step and held
    until the step is committed: scratch allocated a whole block up front cost 256 KiB
    (640 KiB rounded) per tensor however small, 1 GB a step for 4000 tensors of 8 bytes."""
    import tracemalloc
    if not fused:
        monkeypatch.setattr(codecs, "_fused", None)
    x = np.arange(2, dtype=np.float32).view(np.uint8)
    base = (np.arange(2, dtype=np.float32) + 1).view(np.uint8)
    held = []
    tracemalloc.start()
    try:
        for _ in range(100):
            delta = Encoder("float32", delta=True)
            delta.add(x, base, base)
            split = rounding.MantissaSplit("float32", 8)
            split.add(x)
            held += [delta, split]
        live, _ = tracemalloc.get_traced_memory()
        for kept in held:
            kept.finish()
        finished, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert live < 100 * 32 * 1024, live
    assert finished <= live
