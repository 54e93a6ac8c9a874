"""Checksums and statistics of a tensor: the C kernel and the numpy path agree with
float64 references, chunk boundaries or not, with NaN and infinities counted."""

import math

import numpy as np
import pytest
import torch
import xxhash

from datastates_hist import digest as digest_module
from datastates_hist.digest import CHUNK, Digest


def reference(values: np.ndarray) -> dict:
    v = values.astype(np.float64).reshape(-1)
    finite = v[np.isfinite(v)]
    return {"norm": float(np.sqrt((v * v).sum())), "min": float(v.min()), "max": float(v.max()),
            "mean": float(v.mean()), "std": float(v.std()), "nonfinite": int(v.size - finite.size)}


def digest_of(src: np.ndarray, dtype: torch.dtype, copy: bool) -> tuple[Digest, np.ndarray]:
    d = Digest()
    if copy:
        dst = np.empty_like(src)
        d.copy_update(dst, src, dtype)
    else:
        dst = src
        d.update(src, dtype)
    return d, dst


@pytest.fixture(params=["kernel", "numpy"])
def path(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(digest_module, "_fused", None)
    return request.param


def test_the_kernel_is_built():
    # a silent fallback to numpy would pass every other test, slower: tools/install.sh builds it
    assert digest_module._fused is not None


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
# 48 and CHUNK + 19: a chunk whose length is not a multiple of either pass's lanes (16, 32)
@pytest.mark.parametrize("n", [1, 7, 48, CHUNK, CHUNK + 19, 3 * CHUNK + 5])
def test_statistics_match_float64_references(path, dtype, n, copy):
    rng = np.random.default_rng(n)
    src = (rng.standard_normal(n) * 3 + 1000).astype(dtype)  # mean >> std: deviations matter
    d, dst = digest_of(src, torch.float32 if dtype == np.float32 else torch.float64, copy)
    assert np.array_equal(dst, src)
    assert d.checksum() == xxhash.xxh3_64_hexdigest(src.tobytes())
    got, want = d.stats(), reference(src)
    assert got["nonfinite"] == 0 and got["min"] == want["min"] and got["max"] == want["max"]
    for key in ("norm", "mean", "std"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-9), key


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("first", [1e6, -3e4, 1000.0])
def test_statistics_do_not_depend_on_how_far_a_chunks_first_value_lies(path, dtype, first):
    """The kernel sums each chunk's values less its first: an outlier there (or a value
    equal to the mean) must not cost the deviations their precision."""
    rng = np.random.default_rng(7)
    src = (rng.standard_normal(3 * CHUNK) * 3 + 1000).astype(dtype)
    src[::CHUNK] = first  # the first value of every chunk
    d, _ = digest_of(src, torch.float32 if dtype == np.float32 else torch.float64, True)
    got, want = d.stats(), reference(src)
    rel = 1e-9 if path == "kernel" or dtype == np.float64 else 1e-5  # numpy sums float32 in float32
    for key in ("norm", "mean", "std"):
        assert got[key] == pytest.approx(want[key], rel=rel), key


@pytest.mark.parametrize("copy", [True, False])
def test_nan_and_infinity_are_counted(path, copy):
    src = np.arange(CHUNK + 10, dtype=np.float32)
    src[3], src[CHUNK + 2] = np.inf, -np.inf
    d, _ = digest_of(src, torch.float32, copy)
    s = d.stats()
    assert s["nonfinite"] == 2 and s["min"] == -np.inf and s["max"] == np.inf
    src[5] = np.nan
    d, _ = digest_of(src, torch.float32, copy)
    s = d.stats()
    assert s["nonfinite"] == 3 and math.isnan(s["min"]) and math.isnan(s["max"])


@pytest.mark.parametrize("copy", [True, False])
def test_an_infinite_first_value_gives_an_infinite_mean(path, copy):
    """The kernel sums values less a chunk's first; one that is infinite must still give
    the plain sum (inf), not the NaN of inf - inf."""
    src = np.arange(1000, dtype=np.float32)
    src[0] = np.inf
    d, _ = digest_of(src, torch.float32, copy)
    s = d.stats()
    assert s["nonfinite"] == 1 and s["mean"] == np.inf and s["max"] == np.inf and s["min"] == 1.0


def test_constant_tensor_has_zero_std(path):
    d, _ = digest_of(np.full(2 * CHUNK + 1, 1.0, dtype=np.float32), torch.float32, True)
    assert d.stats()["std"] == 0.0 and d.stats()["mean"] == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.complex64])
def test_other_dtypes_are_summarised_as_their_values(path, dtype):
    t = (torch.randn(CHUNK + 3) * 5).to(dtype)
    raw = t.view(torch.uint16).numpy() if dtype in (torch.bfloat16, torch.float16) else t.numpy()
    d, dst = digest_of(raw, dtype, True)
    assert np.array_equal(dst, raw)
    values = (t.abs() if dtype.is_complex else t).to(torch.float64).numpy()
    got, want = d.stats(), reference(values)
    for key in ("norm", "min", "max", "mean", "std"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-9), key


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("where", [[5], [CHUNK + 5], [5, 2 * CHUNK + 1]], ids=["first chunk", "second", "both"])
@pytest.mark.parametrize("values", [[np.inf], [-np.inf], [np.inf, -np.inf], [np.nan]], ids=str)
def test_statistics_of_a_tensor_with_nonfinite_values_in_any_chunk_are_numpys(path, copy, where, values):
    """Over several chunks, as over one: infinities give numpy's mean and norm (an
    infinite one, or NaN for inf - inf), NaN gives NaN, and std is NaN (numpy's: inf - inf
    in the deviations); merging chunks' means and deviations would make each of them NaN."""
    src = np.linspace(-2, 3, 3 * CHUNK, dtype=np.float32)
    for k, at in enumerate(where):
        src[at] = values[k % len(values)]
    d, _ = digest_of(src, torch.float32, copy)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf in numpy's reference
        got, want = d.stats(), reference(src)
    assert got["nonfinite"] == want["nonfinite"] == len(where)
    for key in ("norm", "min", "max", "mean", "std"):
        assert got[key] == want[key] or (math.isnan(got[key]) and math.isnan(want[key])), (key, got, want)


@pytest.mark.parametrize("values", [[], [np.inf], [np.inf, -np.inf], [np.nan]], ids=str)
@pytest.mark.parametrize("block", [0, 2])
def test_blocks_statistics_combined_are_the_whole_tensors(values, block):
    """A tensor written in blocks by several ranks: its statistics from its blocks' are
    those of the whole (a NaN in any block, first or last, makes min and max NaN)."""
    from datastates_hist.sharding import combine_stats

    src = np.linspace(-2, 3, 3000, dtype=np.float32)
    for k, v in enumerate(values):
        src[(block * 1000 + 10 + k * 1000) % 3000] = v  # the second value in the next block
    parts = []
    for b in range(3):
        d = Digest()
        d.update(src[b * 1000:(b + 1) * 1000], torch.float32)
        parts.append((1000, d.stats()))
    got = combine_stats(parts)
    with np.errstate(invalid="ignore", over="ignore"):
        want = reference(src)
    assert got["nonfinite"] == want["nonfinite"] == len(values)
    for key in ("norm", "min", "max", "mean", "std"):
        same = got[key] == pytest.approx(want[key], rel=1e-6) if np.isfinite(want[key]) else got[key] == want[key]
        assert same or (math.isnan(got[key]) and math.isnan(want[key])), (key, got, want)


# --- finite values whose squares overflow float64 -------------------------------------------


def scaled_reference(values: np.ndarray) -> dict:
    """numpy's figures of float64 ``values`` scaled below 1 by a power of two (exact, but
    for values 2**-1000 times the largest, whose squares count for nothing), summed with
    math.fsum (correctly rounded), deviations from that mean: squares that cannot overflow."""
    v = values.astype(np.float64).reshape(-1)
    k = math.frexp(float(np.abs(v).max()))[1]
    s = np.ldexp(v, -k)
    mean = math.fsum(s) / s.size
    dev = s - mean
    return {"norm": math.sqrt(math.fsum(s * s)) * 2.0 ** k, "min": float(v.min()), "max": float(v.max()),
            "mean": math.ldexp(mean, k), "std": math.sqrt(math.fsum(dev * dev) / s.size) * 2.0 ** k}


def huge_values(scale: float, kind: str, n: int = 3 * CHUNK + 5) -> np.ndarray:
    """Values of magnitude ``scale``, whose squares overflow; mean 3 * scale, so that the
    mean is checked as tightly as the rest. ``mixed``: among values near 1 in every
    chunk; ``growing``: chunks of 1e100 (whose squares do not overflow), then ``scale``,
    then 1e300, so that the scale grows twice; ``small_first``: a first chunk near 1."""
    rng = np.random.default_rng(int(math.log10(scale)))
    src = (rng.standard_normal(n) + 3) * scale
    if kind == "mixed":
        src[::3] = rng.standard_normal(src[::3].size)
    elif kind == "growing":
        src[:CHUNK] = rng.standard_normal(CHUNK) * 1e100
        src[2 * CHUNK:] = (rng.standard_normal(n - 2 * CHUNK) + 3) * 1e300
    elif kind == "small_first":
        src[:CHUNK] = rng.standard_normal(CHUNK)
    return src


def assert_close_to_reference(got: dict, src: np.ndarray) -> None:
    want = scaled_reference(src)
    assert got["nonfinite"] == 0 and got["min"] == want["min"] and got["max"] == want["max"], (got, want)
    for key in ("norm", "mean", "std"):
        assert math.isfinite(got[key]) and got[key] == pytest.approx(want[key], rel=1e-12), (key, got, want)


def digest_in_pieces(src: np.ndarray, sizes: list[int], copy: bool) -> Digest:
    """A Digest of ``src`` given piece by piece (``sizes``, then the rest), as the flush streams it."""
    d = Digest()
    dst = np.empty_like(src)
    cuts = np.cumsum([0, *sizes, src.size - sum(sizes)])
    for a, b in zip(cuts[:-1], cuts[1:]):
        if copy:
            d.copy_update(dst[a:b], src[a:b], torch.float64)
        else:
            d.update(src[a:b], torch.float64)
    return d


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("kind", ["alone", "mixed", "growing", "small_first"])
@pytest.mark.parametrize("scale", [1e160, 1e300])
def test_statistics_of_float64_values_whose_squares_overflow(path, scale, kind, copy):
    """Squares of values beyond about 1e154 overflow float64, though the norm and std
    of such values are numbers: they were NaN."""
    src = huge_values(scale, kind)
    d, dst = digest_of(src, torch.float64, copy)
    assert np.array_equal(dst, src)
    assert_close_to_reference(d.stats(), src)


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("kind", ["alone", "mixed", "growing", "small_first"])
def test_statistics_of_huge_values_in_pieces_are_the_whole_tensors(path, kind, copy):
    """Pieces cut at chunk boundaries give the same figures, bit for bit, as the tensor
    read whole; pieces cut anywhere, the same to rounding."""
    src = huge_values(1e300, kind)
    whole = digest_of(src, torch.float64, copy)[0].stats()
    assert digest_in_pieces(src, [CHUNK, 2 * CHUNK], copy).stats() == whole
    assert_close_to_reference(digest_in_pieces(src, [1000, CHUNK + 17, 5], copy).stats(), src)


def test_statistics_of_a_constant_tensor_whose_sum_overflows(path):
    """A chunk of 1e304s sums beyond float64's largest: its mean is exact and its std 0."""
    src = np.full(3 * CHUNK + 5, 1e304)
    s = digest_of(src, torch.float64, True)[0].stats()
    assert s["mean"] == 1e304 and s["std"] == 0.0 and s["nonfinite"] == 0
    assert s["norm"] == pytest.approx(1e304 * math.sqrt(src.size), rel=1e-12)


def test_huge_values_with_nonfinite_ones_keep_numpys_figures(path):
    """An infinity or NaN among huge values: counted, and the figures numpy's, as for any other."""
    for bad in (np.inf, np.nan):
        src = huge_values(1e300, "alone")
        src[2 * CHUNK + 3] = bad
        got = digest_of(src, torch.float64, True)[0].stats()
        with np.errstate(invalid="ignore", over="ignore"):
            want = reference(src)
        assert got["nonfinite"] == want["nonfinite"] == 1
        for key in ("norm", "min", "max", "mean", "std"):
            assert got[key] == want[key] or (math.isnan(got[key]) and math.isnan(want[key])), (key, got, want)


def test_blocks_of_huge_values_combine_into_the_whole_tensor():
    from datastates_hist.sharding import combine_stats

    src = huge_values(1e300, "mixed")
    cuts = [0, 1000, 2 * CHUNK + 7, src.size]
    parts = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        d = Digest()
        d.update(src[a:b], torch.float64)
        parts.append((b - a, d.stats()))
    got, want = combine_stats(parts), scaled_reference(src)
    for key in ("norm", "mean", "std"):
        assert got[key] == pytest.approx(want[key], rel=1e-12), key


def reference_ratio(x: np.ndarray, base: np.ndarray) -> float:
    """||x - base|| / ||base|| of float values, as :func:`scaled_reference` sums them."""
    x, base = x.astype(np.float64).reshape(-1), base.astype(np.float64).reshape(-1)
    k = math.frexp(float(max(np.abs(x).max(), np.abs(base).max())))[1]
    xs, bs = np.ldexp(x, -k), np.ldexp(base, -k)
    return math.sqrt(math.fsum((xs - bs) ** 2) / math.fsum(bs * bs))


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "numpy"])
@pytest.mark.parametrize("dtype, scale", [("float64", 1e160), ("float64", 1e300), ("float32", 1e30),
                                          ("bfloat16", 1e30)])
@pytest.mark.parametrize("small_first", [False, True])
def test_update_ratio_of_values_whose_squares_overflow(dtype, scale, small_first, kernel, monkeypatch):
    """||x - base|| / ||base|| of float64 values beyond about 1e154 (and of float32 ones
    beyond about 1e19, which numpy squares in float32) was None: the squares overflowed.
    Two chunks of the encoder, the first of values near 1 or not."""
    from datastates_hist import codecs

    if not kernel:
        monkeypatch.setattr(codecs, "_fused", None)
    tdtype = getattr(torch, dtype)
    n = 2 * codecs.CHUNK_BYTES // tdtype.itemsize - 1000  # two chunks, the second not full
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(n, generator=gen, dtype=torch.float64) * scale
    x = base * 1.01 + torch.randn(n, generator=gen, dtype=torch.float64) * (scale / 100)
    if small_first:
        first = codecs.CHUNK_BYTES // tdtype.itemsize
        base[:first] /= scale
        x[:first] /= scale
    base, x = base.to(tdtype), x.to(tdtype)
    raw = [t.view(torch.uint8).numpy().reshape(-1) for t in (x, base)]
    enc = codecs.Encoder(dtype, delta=True)
    enc.add(*raw)
    ratio = enc.finish()[2]
    assert ratio is not None and ratio == pytest.approx(reference_ratio(x.double().numpy(), base.double().numpy()),
                                                        rel=1e-12)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "numpy"])
def test_update_ratio_of_huge_values_with_a_nan_is_none(kernel, monkeypatch):
    from datastates_hist import codecs

    if not kernel:
        monkeypatch.setattr(codecs, "_fused", None)
    n = 2 * codecs.CHUNK_BYTES // 8
    base = np.random.default_rng(4).standard_normal(n) * 1e300
    for where in (3, n - 3):  # with the overflowing chunk, or after it
        x = base * 1.01
        x[where] = np.nan
        enc = codecs.Encoder("float64", delta=True)
        enc.add(x.view(np.uint8), base.view(np.uint8))
        assert enc.finish()[2] is None


def test_a_run_of_huge_float64_weights_stores_finite_statistics(tmp_path):
    """Written and read back (History.stats): norm, std and the update ratio of float64
    weights near 1e300 are the numbers they are, not NaN."""
    import datastates_hist as dh

    torch.manual_seed(0)
    model = torch.nn.Linear(256, 300, dtype=torch.float64)  # 76800 weights: two chunks
    w0 = torch.randn(300, 256, dtype=torch.float64) * 1e300
    weights = [w0, w0 * 1.01, w0 * 1.01 + torch.randn(300, 256, dtype=torch.float64) * 1e297]
    with dh.Checkpointer(str(tmp_path / "run"), key_every=4) as ckpt:
        for step, w in enumerate(weights):
            with torch.no_grad():
                model.weight.copy_(w)
            ckpt.write(step, model)
            ckpt.wait_snapshot()  # the next step edits the weights in place
    with dh.open(str(tmp_path / "run")) as h:
        df = h.stats("weight")
    assert list(df.index) == [0, 1, 2]
    for step, w in enumerate(weights):
        want = scaled_reference(w.numpy())
        for key in ("norm", "std", "mean"):
            assert math.isfinite(df[key][step]) and df[key][step] == pytest.approx(want[key], rel=1e-12), (key, step)
        if step:
            ratio = reference_ratio(w.numpy(), weights[step - 1].numpy())
            assert df["update_ratio"][step] == pytest.approx(ratio, rel=1e-12), step
