"""Each step records how a tensor's values are distributed (by sign and binary
exponent): exact counts, the same from the C kernel and from numpy, kept in the
manifest and the index, read back by ``History.histogram``."""

import json
import math
import sqlite3
import subprocess
import sys

import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist import digest
from datastates_hist.digest import Digest, combine_distributions
from datastates_hist.errors import CorruptionError

BACKENDS = ["adios2", "hdf5"]


def expected(t: torch.Tensor) -> dict:
    """The distribution of ``t``, counted from float64 values with log2 (independent of
    the bit layout the writer counts from); subnormal float32 values count as zero."""
    v = t.double().flatten()
    v = v[torch.isfinite(v)]
    tiny = 2.0 ** -126 if t.dtype != torch.float64 else 2.0 ** -1022
    zero = int((v.abs() < tiny).sum())
    v = v[v.abs() >= tiny]
    e = torch.floor(torch.log2(v.abs())).long()
    lo, hi = int(e.min()), int(e.max()) + 1
    return {"exp0": lo, "zero": zero,
            "negative": [int(((e == k) & (v < 0)).sum()) for k in range(lo, hi)],
            "positive": [int(((e == k) & (v > 0)).sum()) for k in range(lo, hi)]}


def values(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    t = (torch.randn(200_003, generator=g) * torch.logspace(-8, 4, 200_003)).to(dtype)
    t[:7] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0], dtype=dtype)
    if dtype == torch.float32:
        t[7:9] = torch.tensor([1e-40, -1e-42])  # subnormal
    return t


def summarised(t: torch.Tensor) -> dict:
    raw = t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
    d = Digest()
    d.update(raw, t.dtype)
    return d.distribution()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_counts_are_exact_from_the_kernel_and_from_numpy(dtype, monkeypatch):
    t = values(dtype)
    found = summarised(t)
    assert found == expected(t)
    assert found["zero"] + sum(found["negative"]) + sum(found["positive"]) == t.numel() - 3  # inf, -inf, NaN
    monkeypatch.setattr(digest, "_fused", None)
    assert summarised(t) == found


def test_copy_update_counts_as_update_does():
    t = values(torch.float32).numpy()
    d = Digest()
    d.copy_update(np.empty_like(t), t, torch.float32)
    assert d.distribution() == expected(torch.from_numpy(t))


def test_integers_have_no_distribution():
    d = Digest()
    d.update(np.arange(10, dtype=np.int64), torch.int64)
    assert d.distribution() is None


def test_blocks_combine_into_the_whole():
    t = values(torch.float32)
    parts = [expected(t[:1000]), expected(t[1000:150_000]), expected(t[150_000:])]
    assert combine_distributions(parts) == expected(t)


def _run(path, backend, steps=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with dh.Checkpointer(path, backend=backend) as ckpt:
        for step in range(steps):
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            ckpt.write(step, model, opt)


@pytest.mark.parametrize("backend", BACKENDS)
def test_history_histogram_counts_each_step(tmp_path, backend):
    run = tmp_path / "run"
    _run(run, backend)
    with dh.open(run) as h:
        df = h.histogram("0.weight")
        assert df.attrs["name"] == "model/0.weight"
        assert list(df.index) == [0, 1, 2]
        cols = list(df.columns)
        assert cols == sorted(cols) and 0.0 in cols
        for step in df.index:
            want = expected(h.read("model/0.weight", step))
            row = df.loc[step]
            assert row[0.0] == want["zero"]
            for i, (neg, pos) in enumerate(zip(want["negative"], want["positive"])):
                assert row.get(-(2.0 ** (want["exp0"] + i)), 0) == neg
                assert row.get(2.0 ** (want["exp0"] + i), 0) == pos
            assert row.sum() == 128
        # the Adam step counter (a float tensor in torch 2.x) sits in bin [2**e, 2**e+1)
        steps = h.histogram("optim/state/0.weight/step")
        assert steps.loc[2, 2.0] == 1 and steps.loc[0, 1.0] == 1


def test_distributions_survive_a_repair(tmp_path):
    run = tmp_path / "run"
    _run(run, "hdf5")
    with dh.open(run) as h:
        before = h.histogram("model/1.weight")
    out = subprocess.run([sys.executable, "-m", "datastates_hist.cli", "repair", str(run), "--force"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    with dh.open(run) as h:
        assert h.histogram("model/1.weight").equals(before)


@pytest.mark.parametrize("crafted", [
    {"exp0": 0, "zero": -1, "negative": [], "positive": []},
    {"exp0": 1100, "zero": 0, "negative": [0], "positive": [1]},  # past float64's exponents
    {"exp0": 1000, "zero": 0, "negative": [0] * 30, "positive": [1] * 30},
    {"exp0": -1100, "zero": 7, "negative": [3], "positive": [5]},
    {"exp0": 0, "zero": 10**30, "negative": [], "positive": []},
    {"exp0": 0, "zero": 0, "negative": [1], "positive": []},
    {"exp0": 0, "zero": 0, "negative": [], "positive": [], "more": 1},
    "not json",
])
def test_a_malformed_distribution_in_the_index_is_named(tmp_path, crafted):
    run = tmp_path / "run"
    _run(run, "hdf5", steps=1)
    with sqlite3.connect(run / "index.sqlite") as conn:
        conn.execute("UPDATE tensors SET distribution=? WHERE name='model/0.bias'",
                     (crafted if isinstance(crafted, str) else json.dumps(crafted),))
    with dh.open(run) as h, pytest.raises(CorruptionError) as err:
        h.histogram("model/0.bias")
    assert str(err.value) == (
        f"the index {run / 'index.sqlite'} is damaged: step 0: tensor 'model/0.bias' has a malformed "
        f"distribution (rebuild it from the step data with: datastates-hist repair {run})")
