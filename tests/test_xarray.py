"""xarray views of a history: ``h.to_xarray`` and ``xr.open_dataset(run, engine="datastates")``.

Every value is compared with numpy on tensors loaded through the Store, and
the reads are counted to show that only the selection is read.
"""

import numpy as np
import pandas as pd
import pytest
import torch

import datastates_hist as dh
from datastates_hist.step_data import StepData
from datastates_hist.store import Store

xr = pytest.importorskip("xarray")
from datastates_hist.xarray_backend import DatastatesBackendEntrypoint  # noqa: E402
from datastates_hist.errors import ShapeChangeError  # noqa: E402

STEPS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
W = "model/0.weight"  # (5, 4)


def build_run(run_dir, backend):
    """A model trained with SGD, plus extras: bfloat16, a tensor that grows, one that appears late."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        for step in STEPS:
            model(torch.randn(8, 4, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            extra = {"late": torch.full((3,), float(step))} if step >= 6 else {}
            ckpt.write(step, model, opt, bf=torch.randn(3, 4, generator=g).to(torch.bfloat16),
                       count=torch.tensor(step * 10),
                       grow=torch.arange(2.0 * (1 + step // 5)).reshape(-1, 2), **extra)


@pytest.fixture
def path(module_runs, backend):
    return module_runs(backend)


@pytest.fixture
def h(path):
    with dh.open(path) as history:
        yield history


def stack(path, name, steps):
    """``name`` at ``steps`` as one numpy array, read through the Store."""
    store = Store(path)
    out = []
    for s in steps:
        with store.open_step(s) as data:
            t = data.read(name)
        out.append(t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy())
    store.close()
    return np.stack(out)


def commit_times(path, steps):
    store = Store(path)
    wall = {r.step: r.time for r in store.index.step_rows()}
    store.close()
    return pd.to_datetime([wall[s] for s in steps], unit="s").values


@pytest.fixture
def reads(monkeypatch):
    """Every read of tensor data: ("read", name, step) or ("box", name, step, start, count)."""
    log = []
    read, read_box = StepData.read, StepData.read_box

    def counted_read(self, name, verify=True):
        log.append(("read", name, self.row.step))
        return read(self, name, verify)

    def counted_box(self, name, start, count):
        log.append(("box", name, self.row.step, tuple(start), tuple(count)))
        return read_box(self, name, start, count)

    monkeypatch.setattr(StepData, "read", counted_read)
    monkeypatch.setattr(StepData, "read_box", counted_box)
    return log


def test_to_xarray_equals_numpy_across_steps(h, path):
    da = h.to_xarray("0.weight")
    want = stack(path, W, STEPS)
    assert da.dims == ("step", "dim_0", "dim_1") and da.shape == (12, 5, 4) and da.dtype == np.float32
    assert da.name == W and da.attrs == {"long_name": W, "dtype": "float32", "shape": [5, 4]}
    assert list(da["step"].values) == STEPS
    assert np.array_equal(da["time"].values, commit_times(path, STEPS))
    assert np.array_equal(da.values, want)
    assert np.array_equal(da.isel(step=slice(None, None, -3), dim_0=[4, 0, 2], dim_1=-1).values,
                          want[::-3][:, [4, 0, 2], -1])
    assert np.array_equal(da.sel(step=[9, 2, 5]).values, want[[9, 2, 5]])
    assert np.array_equal(da.sel(step=7)[1:4, ::-2].values, want[7, 1:4, ::-2])
    assert np.array_equal(da[2:9:2, -1, 1].values, want[2:9:2, -1, 1])
    # orthogonal index lists on several dims, and pointwise (vectorized) indexing
    assert np.array_equal(da.isel(step=[1, 3], dim_0=[4, 0, 2], dim_1=[3, 0]).values,
                          want[[1, 3]][:, [4, 0, 2]][:, :, [3, 0]])
    k = {"dim_0": xr.DataArray([0, 4, 4], dims="k"), "dim_1": xr.DataArray([1, 2, 0], dims="k")}
    assert np.array_equal(da.isel(**k).values, want[:, [0, 4, 4], [1, 2, 0]])
    # xarray arithmetic on the lazy array: the mean trajectory over steps
    assert np.allclose(da.mean(("dim_0", "dim_1")).values, want.mean(axis=(1, 2)))


def test_steps_are_chosen_by_value(h, path):
    da = h.to_xarray("0.weight", steps=slice(0, 1000, 4))
    assert list(da["step"].values) == [0, 4, 8]
    assert np.array_equal(da.values, stack(path, W, [0, 4, 8]))
    assert list(h.to_xarray(W, steps=slice(3, 7)).step.values) == [3, 4, 5, 6]
    assert list(h.to_xarray(W, steps=slice(5, None, 5)).step.values) == [5, 10]
    da = h.to_xarray(W, steps=[10, 1, 7])  # a list keeps its order
    assert list(da.step.values) == [10, 1, 7]
    assert np.array_equal(da.values, stack(path, W, [10, 1, 7]))
    assert h.to_xarray(W, steps=slice(100, 200)).shape == (0, 5, 4)
    with pytest.raises(dh.StepNotFoundError, match=r"steps \[99\] are not committed"):
        h.to_xarray(W, steps=[3, 99])
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        h.to_xarray("nope")
    with pytest.raises(ValueError, match="must go forward"):
        h.to_xarray(W, steps=slice(None, None, -1))
    # numpy integers are steps; a float is refused, not rounded to a step it does not name
    assert list(h.to_xarray(W, steps=np.arange(3, 6)).step.values) == [3, 4, 5]
    assert list(h.to_xarray(W, steps=slice(np.int64(5), None, np.int64(5))).step.values) == [5, 10]
    for steps, message in [([1.5], "a step is a whole number (int), got 1.5"),
                           (slice(0, 4, 0.5), "a step is a whole number (int), got 0.5"),
                           ("3", "steps: None, a slice, a step or a list of steps, got '3'"),
                           (3.0, "steps: None, a slice, a step or a list of steps, got 3.0")]:
        with pytest.raises(TypeError) as err:
            h.to_xarray(W, steps=steps)
        assert str(err.value) == message
    with pytest.raises(TypeError) as err:
        h.to_xarray(3)
    assert str(err.value) == "a tensor name is a str, got 3"


def test_only_the_selection_is_read(h, reads):
    da = h.to_xarray("0.weight")
    ds = xr.open_dataset(h.path, engine="datastates", names="0.weight")
    assert reads == []  # opening reads the index only
    assert da[3, 1, 2].item() == h.read(W, 3)[1, 2].item()
    reads.pop()  # the reference read just above
    assert reads == [("box", W, 3, (1, 2), (1, 1))]
    reads.clear()
    ds["model.0.weight"].isel(step=[2, 9], dim0_5=slice(1, 3)).values
    assert reads == [("box", W, 2, (1, 0), (2, 4)), ("box", W, 9, (1, 0), (2, 4))]
    reads.clear()
    # a whole step is read with its checksum checked
    da.sel(step=4).values
    assert reads == [("read", W, 4)]
    ds.close()


def test_one_element_of_a_big_tensor_reads_one_element(tmp_path, backend, reads):
    run = str(tmp_path / "big")
    big = torch.arange(3_000_000, dtype=torch.float32).reshape(1000, 3000)
    with dh.Checkpointer(run, backend=backend) as ckpt:
        for step in range(3):
            ckpt.write(step, torch.nn.Linear(1, 1), big=big + step)
    with dh.open(run) as h:
        da = h.to_xarray("extra/big")
        assert da[:, 765, 4321 % 3000].values.tolist() == [765 * 3000 + 1321 + s for s in range(3)]
    assert reads == [("box", "extra/big", s, (765, 1321), (1, 1)) for s in range(3)]


def test_open_dataset_variables_coords_and_attrs(path):
    with pytest.warns(UserWarning, match=r"extra/grow: \[1, 2\] float32 -> \[2, 2\] float32 at step 5"), \
            pytest.warns(UserWarning, match=r"missing from some of the steps and are left out: extra/late"):
        ds = xr.open_dataset(path, engine="datastates")
    # named by the stored name with "/" as "."; the optimizer's options are scalars over step
    assert set(ds.data_vars) == {"model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias", "extra.bf",
                                 "extra.count", "rng.torch",
                                 "optim.state.0.weight.momentum_buffer", "optim.state.0.bias.momentum_buffer",
                                 "optim.state.2.weight.momentum_buffer", "optim.state.2.bias.momentum_buffer",
                                 *(f"optim.param_groups.0.{k}" for k in ("lr", "momentum", "dampening", "weight_decay",
                                                                         "nesterov", "maximize", "differentiable"))}
    assert ds.attrs["inconsistent_shapes"] == "extra/grow"  # one name a line
    assert ds.attrs["partial_tensors"] == "extra/late"
    assert list(ds["step"].values) == STEPS
    assert np.array_equal(ds["time"].values, commit_times(path, STEPS))
    with dh.open(path) as h:
        stored = h.names() + h.scalar_names()
    for name, var in ds.data_vars.items():
        assert var.dims[0] == "step" and var.attrs["long_name"] in stored
        assert name == var.attrs["long_name"].replace("/", ".")
    w = ds["model.0.weight"]
    assert w.dims == ("step", "dim0_5", "dim1_4")  # shared: axis 0 of length 5 is dim0_5 in every tensor
    assert ds["optim.state.0.weight.momentum_buffer"].dims == w.dims and ds["model.0.bias"].dims == ("step", "dim0_5")
    assert w.attrs == {"long_name": W, "dtype": "float32", "shape": [5, 4]}
    assert ds["optim.param_groups.0.lr"].values.tolist() == [0.1] * 12
    assert np.array_equal(w.values, stack(path, W, STEPS))
    m = ds["optim.state.2.bias.momentum_buffer"]
    assert np.array_equal(m.isel(step=-1).values, stack(path, "optim/state/2.bias/momentum_buffer", [11])[0])
    assert ds["rng.torch"].dtype == np.uint8
    count = ds["extra.count"]  # a 0-d tensor: one value per step
    assert count.dims == ("step",) and count.dtype == np.int64 and count.attrs["shape"] == []
    assert count.values.tolist() == [10 * s for s in STEPS]
    assert count.sel(step=[4, 9]).values.tolist() == [40, 90]
    ds.close()


def test_open_dataset_names_steps_and_drop(path):
    ds = xr.open_dataset(path, engine="datastates", names=["0.*", "extra/*"], steps=slice(6, 10),
                         drop_variables=["model.0.bias"])
    # in steps 6..9 "grow" has one shape and "late" exists throughout
    assert set(ds.data_vars) == {"model.0.weight", "extra.bf", "extra.count", "extra.grow", "extra.late"}
    assert ds.attrs["inconsistent_shapes"] == "" and ds.attrs["partial_tensors"] == ""
    assert list(ds.step.values) == [6, 7, 8, 9]
    assert np.array_equal(ds["extra.late"].values, stack(path, "extra/late", range(6, 10)))
    assert np.array_equal(ds["extra.grow"].values, stack(path, "extra/grow", range(6, 10)))
    ds.close()


def test_open_dataset_refuses_names_that_match_nothing_and_steps_listed_twice(path, h):
    """A name or glob that selects no tensor and no scalar is a KeyError, as h.to_xarray's
    and h.trace's are, not a dataset without it; a step listed twice is refused by both."""
    for names, unmatched, hint in [
            ("0.wieght", "'0.wieght'", "; close names: model/0.weight, model/2.weight"),
            ("model/blocks.*", "'model/blocks.*'", ""),
            (["0.weight", "lrr", "nothing*"], "'lrr', 'nothing*'", "; close names: optim/param_groups/0/lr")]:
        with pytest.raises(KeyError) as caught:
            xr.open_dataset(path, engine="datastates", names=names)
        assert caught.value.args[0] == f"no tensor or scalar of {h.path} matches {unmatched}{hint}"
    with pytest.raises(KeyError, match="no tensor '0.wieght'"):
        h.trace("0.wieght")
    # a name held by other steps than those chosen is no typo: its variable is left out, as before
    ds = xr.open_dataset(path, engine="datastates", names=["extra/late", "optim/param_groups/0/lr"], steps=[0, 1])
    assert set(ds.data_vars) == {"optim.param_groups.0.lr"}
    ds.close()
    for steps in ([3, 3], [4, 3, 4]):
        for read in (lambda: xr.open_dataset(path, engine="datastates", names="0.bias", steps=steps),
                     lambda: h.to_xarray("0.bias", steps=steps)):
            with pytest.raises(ValueError) as caught:
                read()
            assert str(caught.value) == f"steps {[steps[0]]} are listed more than once: list each step once"
    with pytest.raises(TypeError, match="a name is a str, got 3"):
        xr.open_dataset(path, engine="datastates", names=["0.bias", 3])


def test_dask_chunks_follow_the_steps(path, h):
    pytest.importorskip("dask")
    with pytest.warns(UserWarning):
        ds = xr.open_dataset(path, engine="datastates", chunks={})
    w = ds["model.0.weight"]
    assert w.chunks == ((1,) * 12, (5,), (4,))
    want = stack(path, W, STEPS)
    assert np.allclose(w.mean("step").compute().values, want.mean(axis=0))
    assert np.array_equal(w.isel(step=slice(2, 8, 3)).values, want[2:8:3])
    ds.close()
    ds = xr.open_dataset(path, engine="datastates", names="0.weight", chunks={"step": 5})
    assert ds["model.0.weight"].chunks[0] == (5, 5, 2)
    ds.close()
    da = h.to_xarray(W).chunk({"step": 4})
    assert np.array_equal(da.max("dim_0").values, want.max(axis=1))


def test_bfloat16_reads_as_float32_with_its_real_dtype(h, path):
    da = h.to_xarray("extra/bf")
    assert da.dtype == np.float32 and da.attrs["dtype"] == "bfloat16" and da.attrs["shape"] == [3, 4]
    want = stack(path, "extra/bf", STEPS)
    assert np.array_equal(da.values, want)
    assert np.array_equal(da[5, ::-1, 1:3].values, want[5, ::-1, 1:3])
    # the values are exactly bfloat16 numbers, widened
    assert np.array_equal(torch.from_numpy(da.values).to(torch.bfloat16).float().numpy(), da.values)


def test_shape_changes_are_reported_not_mangled(h, path):
    with pytest.raises(ShapeChangeError, match=r"'extra/grow'.*\[1, 2\] float32 -> \[2, 2\] float32 at step 5; "
                                               r"\[2, 2\] float32 -> \[3, 2\] float32 at step 10"):
        h.to_xarray("extra/grow")
    da = h.to_xarray("extra/grow", steps=slice(5, 10))  # one shape in these steps
    assert da.shape == (5, 2, 2)
    assert np.array_equal(da.values, stack(path, "extra/grow", range(5, 10)))
    # a tensor that some steps lack: the steps that hold it, or an error for listed ones
    late = h.to_xarray("extra/late")
    assert list(late.step.values) == [6, 7, 8, 9, 10, 11]
    assert np.array_equal(late.values[:, 0], np.arange(6.0, 12.0))
    with pytest.raises(KeyError, match=r"not in steps \[2\]"):
        h.to_xarray("extra/late", steps=[2, 6])


def test_engine_is_registered_and_guesses_runs(path, tmp_path):
    assert "datastates" in xr.backends.list_engines()
    entry = DatastatesBackendEntrypoint()
    assert entry.guess_can_open(path) and not entry.guess_can_open(str(tmp_path))
    assert not entry.guess_can_open(str(tmp_path / "missing.nc"))


def test_a_selection_exports_to_netcdf_with_the_default_engine(path, tmp_path):
    with pytest.warns(UserWarning):
        ds = xr.open_dataset(path, engine="datastates")
    part = ds[["model.0.weight", "extra.count", "optim.param_groups.0.lr"]].isel(step=slice(2, 8))
    out = str(tmp_path / "part.nc")
    part.to_netcdf(out)  # netCDF3 without netCDF4 installed: no 64-bit integers, times as float seconds
    with xr.open_dataset(out) as back:
        assert list(back.step.values) == STEPS[2:8]
        assert np.array_equal(back["time"].values.astype("datetime64[ms]"),
                              commit_times(path, STEPS[2:8]).astype("datetime64[ms]"))
        assert np.array_equal(back["model.0.weight"].values, stack(path, W, STEPS[2:8]))
        assert back["extra.count"].values.tolist() == [10 * s for s in STEPS[2:8]]
        assert back["model.0.weight"].attrs["long_name"] == W
        assert back["optim.param_groups.0.lr"].values.tolist() == [0.1] * 6
    ds.close()
