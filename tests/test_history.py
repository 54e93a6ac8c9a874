"""The History API (``dh.open``): every figure it gives equals numpy on tensors loaded independently."""

import fnmatch

import numpy as np
import pandas as pd
import pytest
import torch

import datastates_hist as dh
from datastates_hist.store import Store

STEPS = list(range(8))


def build_run(run_dir, backend, seed=0, steps=STEPS):
    """Train a small model with Adam, checkpointing ``steps``, with extras that test edge cases."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(seed + 1)
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        for step in steps:
            loss = model(torch.randn(16, 6, generator=g)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            partial = torch.zeros(20)
            partial[:step] = 1.0  # step s differs from step a in exactly s - a elements
            ckpt.write(step, model, opt,
                       frozen=torch.arange(12.0).reshape(3, 4),
                       partial=partial,
                       zeros=torch.zeros(5),
                       bf=torch.randn(4, 6, generator=g).to(torch.bfloat16),
                       cplx=torch.randn(3, 3, dtype=torch.complex64, generator=g),
                       grow=torch.ones(1 + step // 4, 2))


def load(run_dir, step, name):
    """Tensor ``name`` of ``step`` as numpy, through the Store (not the History)."""
    store = Store(run_dir)
    try:
        with store.open_step(step) as data:
            t = data.read(name)
    finally:
        store.close()
    return t.float().numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()


def stored_names(run_dir, step):
    store = Store(run_dir)
    try:
        return [r.name for r in store.records(step)]
    finally:
        store.close()


def as_real64(a):
    """float64 numpy; complex as (real, imag) pairs, like the diff metrics."""
    if np.iscomplexobj(a):
        a = np.stack([a.real, a.imag], axis=-1)
    return np.asarray(a, dtype=np.float64).reshape(-1)


def numpy_stats(a):
    v = np.abs(a) if np.iscomplexobj(a) else a
    v = np.asarray(v, dtype=np.float64)
    return {"norm": np.sqrt((v ** 2).sum()), "min": v.min(), "max": v.max(), "mean": v.mean(),
            "std": v.std(), "nonfinite": int((~np.isfinite(v)).sum())}


def numpy_diff(x, y):
    changed = float((x != y).mean())
    x, y = as_real64(x), as_real64(y)
    d = y - x
    nx, ny = np.linalg.norm(x), np.linalg.norm(y)
    l2 = np.linalg.norm(d)
    return {"l2": l2, "rel_l2": l2 / nx if nx else (0.0 if l2 == 0 else np.inf),
            "max_abs": np.abs(d).max(), "cosine": x @ y / (nx * ny) if nx and ny else np.nan,
            "frac_changed": changed}


@pytest.fixture
def built_dir(module_runs, backend):
    return module_runs(backend)


@pytest.fixture
def run(built_dir):
    with dh.open(built_dir) as h:
        yield h


def test_steps_and_tensor_table_match_numpy(run, built_dir):
    assert run.steps == STEPS
    df = run.tensors(5)
    assert list(df["name"]) == stored_names(built_dir, 5)
    assert {"model/0.weight", "model/1.num_batches_tracked", "optim/state/0.weight/exp_avg",
            "extra/bf", "extra/cplx"} <= set(df["name"])
    for row in df.itertuples():
        a = load(built_dir, 5, row.name)
        assert row.shape == a.shape, row.name
        want = numpy_stats(a)
        for key in ("norm", "min", "max", "mean", "std"):
            # the writer reduces in float32: compare to float64 numpy within float32 accuracy
            assert getattr(row, key) == pytest.approx(want[key], rel=1e-5, abs=1e-6), (row.name, key)
        assert row.nonfinite == 0
    bf = df.set_index("name").loc["extra/bf"]
    assert bf["dtype"] == "bfloat16" and bf["nbytes"] == 4 * 6 * 2


def test_stats_per_step_match_numpy(run, built_dir):
    df = run.stats("0.weight")
    assert df.attrs["name"] == "model/0.weight"
    assert list(df.index) == STEPS
    store = Store(built_dir)
    times = {r.step: r.time for r in store.index.step_rows()}
    store.close()
    for step in STEPS:
        want = numpy_stats(load(built_dir, step, "model/0.weight"))
        got = df.loc[step]
        assert got["time"] == times[step]
        for key in ("norm", "min", "max", "mean", "std"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (step, key)
    # the trajectory is really per step: Adam moves the weights every step
    assert df["norm"].nunique() == len(STEPS)


INDEXES = [
    (slice(0, 2), slice(None)), 1, -1, (1, -2), (-3, 0),
    slice(None, None, -1), (slice(None, None, -2), slice(1, None, 3)),
    (Ellipsis, 0), (Ellipsis, slice(4, 0, -3)), (slice(6, 1, -2), Ellipsis), (2, Ellipsis),
    (slice(5, 20), slice(None)), (slice(3, 3), slice(None)), (slice(None, None, -1), slice(None, None, -1)),
    (slice(-2, None), slice(-4, -1)), (np.int64(3), slice(None, None, 2)), (slice(1, 7, 3), 5),
    (),
]


def test_read_selections_match_numpy_slicing(run, built_dir):
    a = load(built_dir, 6, "model/0.weight")  # (8, 6)
    assert np.array_equal(run.read("0.weight", 6).numpy(), a)
    for index in INDEXES:
        got = run.read("model/0.weight", 6, index=index)
        want = a[index]
        assert got.dtype == torch.float32 and tuple(got.shape) == want.shape, index
        assert np.array_equal(got.numpy(), want), index
    # bfloat16 (stored as bits), complex and a scalar int buffer
    bf = run.read("extra/bf", 3, index=(slice(None, None, -1), slice(1, 5, 2)))
    assert bf.dtype == torch.bfloat16
    assert np.array_equal(bf.float().numpy(), load(built_dir, 3, "extra/bf")[::-1, 1:5:2])
    c = run.read("extra/cplx", 4, index=(slice(None, None, -2), 1))
    assert np.array_equal(c.numpy(), load(built_dir, 4, "extra/cplx")[::-2, 1])
    n = run.read("model/1.num_batches_tracked", 7, index=())
    assert n.item() == load(built_dir, 7, "model/1.num_batches_tracked").item() == 8


def test_read_rejects_bad_indexes(run):
    with pytest.raises(IndexError, match="out of bounds"):
        run.read("0.weight", 0, index=(8, 0))
    with pytest.raises(IndexError, match="too many indices"):
        run.read("0.weight", 0, index=(0, 0, 0))
    with pytest.raises(TypeError, match="unsupported index"):
        run.read("0.weight", 0, index=[0, 1])
    # a bool is an int to Python, but no position: numpy takes True as a new axis
    for index in (True, False, np.True_, (0, True)):
        with pytest.raises(TypeError) as exc:
            run.read("0.weight", 0, index=index)
        assert str(exc.value) == (f"unsupported index {(index[1] if isinstance(index, tuple) else index)!r}: "
                                  "a bool is no position; use ints, slices and ...")


def test_diff_metrics_match_numpy(run, built_dir):
    a, b = 2, 7
    df = run.diff(a, b)
    # every tensor of both steps but the RNG states (they say nothing about the model)
    both = [n for n in stored_names(built_dir, a) if n in stored_names(built_dir, b) and not n.startswith("rng/")]
    assert list(df["name"]) == both
    for row in df.itertuples():
        if row.name == "extra/grow":  # (1, 2) -> (2, 2): reported, not compared
            assert row.note == "shape [1, 2] -> [2, 2]" and np.isnan(row.l2)
            continue
        want = numpy_diff(load(built_dir, a, row.name), load(built_dir, b, row.name))
        for key, value in want.items():
            got = getattr(row, key)
            if np.isnan(value):
                assert np.isnan(got), (row.name, key)
            else:
                assert got == pytest.approx(value, rel=1e-9, abs=1e-12), (row.name, key)
    by = df.set_index("name")
    assert by.loc["extra/partial", "frac_changed"] == pytest.approx((b - a) / 20)
    assert by.loc["extra/frozen", ["l2", "max_abs", "frac_changed"]].tolist() == [0.0, 0.0, 0.0]
    assert by.loc["extra/frozen", "cosine"] == pytest.approx(1.0)
    assert by.loc["extra/zeros", "rel_l2"] == 0.0 and np.isnan(by.loc["extra/zeros", "cosine"])
    assert by.loc["model/0.weight", "frac_changed"] == 1.0  # Adam moves every weight


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_diff_of_float8_tensors_is_that_of_their_values(tmp_path, dtype):
    """torch has no isnan or trunc for float8: they are compared as the float32 values they
    hold (exactly), NaN in both steps left out as for every float."""
    values = [torch.tensor([1.0, 2.0, -0.5, float("nan")]), torch.tensor([1.0, 3.0, -0.5, float("nan")])]
    with dh.Checkpointer(tmp_path / "run") as ckpt:
        for step, v in enumerate(values):
            ckpt.write(step, torch.nn.Linear(1, 1), f8=v.to(dtype), f32=v.to(dtype).float())
    with dh.open(tmp_path / "run") as h:
        df = h.diff(0, 1, names=["extra/f8", "extra/f32"]).set_index("name")
    metrics = ["l2", "rel_l2", "max_abs", "cosine", "frac_changed", "integral"]
    np.testing.assert_equal(df.loc["extra/f8", metrics].tolist(), df.loc["extra/f32", metrics].tolist())
    assert df.loc["extra/f8", ["l2", "max_abs", "frac_changed", "integral"]].tolist() == [1.0, 1.0, 0.25, False]


def test_diff_name_patterns(run):
    df = run.diff(0, 3, names="0.*")
    assert sorted(df["name"]) == ["model/0.bias", "model/0.weight"]
    df = run.diff(0, 3, names=["optim/state/3.*/exp_avg", "extra/b?"])
    assert sorted(df["name"]) == ["extra/bf", "optim/state/3.bias/exp_avg", "optim/state/3.weight/exp_avg"]
    with pytest.raises(KeyError, match="no tensor matches"):
        run.diff(0, 3, names="nothing.*")


def test_diff_across_two_runs(run, built_dir, backend, tmp_path):
    other_dir = str(tmp_path / "other")
    build_run(other_dir, backend, seed=1, steps=[0, 4])
    with dh.open(other_dir) as h2:
        df = run.diff(3, 4, names=["*weight", "extra/*"], other=h2)
    names = [n for n in stored_names(built_dir, 3) if n in stored_names(other_dir, 4)
             and (fnmatch.fnmatchcase(n.removeprefix("model/"), "*weight") or fnmatch.fnmatchcase(n, "*weight")
                  or n.startswith("extra/"))]
    assert list(df["name"]) == names and "model/3.weight" in names
    for row in df.itertuples():
        if row.name == "extra/grow":
            assert row.note == "shape [1, 2] -> [2, 2]"
            continue
        want = numpy_diff(load(built_dir, 3, row.name), load(other_dir, 4, row.name))
        for key, value in want.items():
            got = getattr(row, key)
            assert (np.isnan(got) and np.isnan(value)) or got == pytest.approx(value, rel=1e-9), (row.name, key)
    # different seeds: the weights differ everywhere, the constant extras nowhere
    by = df.set_index("name")
    assert by.loc["model/0.weight", "frac_changed"] == 1.0 and by.loc["extra/frozen", "l2"] == 0.0


def test_unknown_names_and_steps_are_clear_errors(run):
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        run.read("nope", 0)
    with pytest.raises(KeyError, match="close names: model/3.weight, model/1.weight, model/0.weight"):
        run.stats(".weight")  # not a name, but the end of several
    with pytest.raises(KeyError, match="no tensor 'blocks.9'"):
        run.stats("blocks.9")
    for call in (lambda: run.read("0.weight", 99), lambda: run.tensors(99), lambda: run.diff(0, 99)):
        with pytest.raises(dh.StepNotFoundError, match="step 99 is not committed"):
            call()


def test_steps_asked_for_by_number(run):
    """A numpy integer (from an array of steps) reads the step it names; a float, a string,
    a bool or None is refused by name, never looked up as a step that is not committed."""
    step = np.int64(STEPS[-1])
    assert torch.equal(run.read("0.weight", step), run.read("0.weight", STEPS[-1]))
    assert run.tensors(step).equals(run.tensors(STEPS[-1]))
    assert run.names(step) == run.names(STEPS[-1])
    assert run.diff(np.int64(STEPS[0]), step).equals(run.diff(STEPS[0], STEPS[-1]))
    for bad in (float(STEPS[-1]), str(STEPS[-1]), True, None):
        calls = [lambda: run.read("0.weight", bad), lambda: run.tensors(bad), lambda: run.diff(STEPS[0], bad)]
        if bad is not None:  # names(None): the names of any step
            calls.append(lambda: run.names(bad))
        for call in calls:
            with pytest.raises(TypeError) as err:
                call()
            assert str(err.value) == f"a step is a whole number (int), got {bad!r}"


def test_names_that_are_no_str_are_refused_by_name(run):
    for call, message in [(lambda: run.read(3, 0), "a tensor name is a str, got 3"),
                          (lambda: run.stats(None), "a tensor name is a str, got None"),
                          (lambda: run.histogram(b"0.weight"), "a tensor name is a str, got b'0.weight'"),
                          (lambda: run.scalar(1), "a scalar name is a str, got 1"),
                          (lambda: run.diff(0, 1, names=5), "names: a name, a glob or a list of them, got 5"),
                          (lambda: run.diff(0, 1, names=["0.weight", 5]), "names: a name is a str, got 5"),
                          (lambda: run.trace(5), "names: a name, a glob or a list of them, got 5"),
                          (lambda: run.scalars([None]), "names: a name is a str, got None")]:
        with pytest.raises(TypeError) as err:
            call()
        assert str(err.value) == message
    assert list(run.trace(("0.weight",)).columns) == ["model/0.weight"]  # any iterable of names


def test_open_history_sees_steps_committed_later(run_dir, backend):
    build_run(run_dir, backend, steps=[0, 1])
    with dh.open(run_dir) as h:
        assert h.steps == [0, 1]
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 3))
        with dh.Checkpointer(run_dir) as ckpt:
            ckpt.write(2, model)
        assert h.steps == [0, 1, 2]
        assert np.array_equal(h.read("3.weight", 2).numpy(), model[3].weight.detach().numpy())
        assert isinstance(h.stats("3.weight"), pd.DataFrame) and list(h.stats("3.weight").index) == [0, 1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64, torch.int64])
def test_diff_metrics_do_not_depend_on_the_chunks_they_are_computed_in(monkeypatch, dtype):
    """compare() works through a tensor in chunks (whole-tensor float64 copies and masks took
    some ten times its size): chunks of 4 elements give what one chunk gives, NaN and
    infinities included."""
    from datastates_hist import history

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 5, generator=g) * 100).to(dtype)
    y = x.clone()
    y.view(-1)[[1, 6, 13, 22, 30]] += 3
    if dtype.is_floating_point:
        x.view(-1)[[9, 17]] = y.view(-1)[[9, 17]] = float("nan")   # NaN on both sides: unchanged
        x.view(-1)[11] = y.view(-1)[11] = float("inf")                # equal infinities differ by 0
    whole = history.compare(x, y)
    monkeypatch.setattr(history, "COMPARE_CHUNK", 4)
    chunked = history.compare(x, y)
    assert whole.keys() == chunked.keys()
    for key, value in whole.items():
        assert chunked[key] == pytest.approx(value, rel=1e-12, nan_ok=True), key
    if dtype.is_floating_point:
        y.view(-1)[25] = float("nan")  # NaN on one side only, in a later chunk: max_abs is NaN
        assert np.isnan(history.compare(x, y)["max_abs"])
        assert history.compare(x, y)["frac_changed"] == pytest.approx(6 / 35)
