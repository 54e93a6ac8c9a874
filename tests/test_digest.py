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
