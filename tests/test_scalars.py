"""Scalars: every plain number written with a step (the loss in ``data=``, the scheduler's
state, each optimizer param group's options), recorded in the index at commit and read
by ``h.scalars()``, ``h.scalar()``, ``h.trace()``, xarray and ``datastates-hist trace``."""

import json
import math
import sqlite3
import subprocess
import sys

import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist.layout import index_path
from datastates_hist.scalars import MAX_LIST, scalars_of
from datastates_hist.store import Store

STEPS = list(range(6))


def loss_at(step):
    return 2.0 / (1 + step)


def build_run(run_dir, backend="adios2", steps=STEPS, model=None, codec="delta"):
    """Two param groups, a scheduler, and ``data=`` holding numbers of every kind."""
    torch.manual_seed(0)
    model = model or torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}],
                          lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with dh.Checkpointer(run_dir, backend=backend, codec=codec) as ckpt:
        for step in steps:
            model(torch.randn(3, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            ckpt.write(step, model, opt, scheduler=sched, data={
                "loss": loss_at(step), "tokens": 10 ** 12 + step, "ok": step % 2 == 0, "big": 2 ** 70,
                "nan": math.nan, "inf": -math.inf, "name": "gpt", "none": None, "blob": b"\x00",
                "pair": (step, 0.5), "series": list(range(MAX_LIST + 1)), "late": step if step >= 3 else None,
            })
    return model


@pytest.fixture
def h(module_runs, backend):
    """The module's run, opened (``h.path`` is its directory)."""
    with dh.open(module_runs(backend)) as history:
        yield history


def cli(*args):
    return subprocess.run([sys.executable, "-m", "datastates_hist.cli", *args], capture_output=True, text=True)


def test_scalar_names_follow_the_stored_values(h):
    assert h.scalar_names() == sorted([
        "extra/data/loss", "extra/data/tokens", "extra/data/ok", "extra/data/big", "extra/data/nan",
        "extra/data/inf", "extra/data/pair/0", "extra/data/pair/1", "extra/data/late",
        "extra/scheduler/step_size", "extra/scheduler/gamma", "extra/scheduler/base_lrs/0",
        "extra/scheduler/base_lrs/1", "extra/scheduler/last_epoch", "extra/scheduler/_step_count",
        "extra/scheduler/_is_initial", "extra/scheduler/_get_lr_called_within_step",
        "extra/scheduler/_last_lr/0", "extra/scheduler/_last_lr/1",
        *(f"optim/param_groups/{g}/{k}" for g in (0, 1) for k in (
            "lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach",
            "differentiable", "fused", "initial_lr") if k not in ("foreach", "fused")),
    ])  # strings, None, bytes, RNG states and lists longer than MAX_LIST are not scalars


def test_values_keep_their_kind(h):
    df = h.scalars()
    assert list(df.index) == STEPS and df.index.name == "step"
    assert df["extra/data/loss"].tolist() == [loss_at(s) for s in STEPS]
    assert df["extra/data/tokens"].tolist() == [10 ** 12 + s for s in STEPS]
    assert df["extra/data/tokens"].dtype == np.int64  # ints stay ints
    assert df["extra/data/ok"].tolist() == [1, 0, 1, 0, 1, 0]  # bools as numbers
    assert df["extra/data/big"].tolist() == [float(2 ** 70)] * 6  # beyond 64 bits: a float
    assert df["extra/data/nan"].isna().all() and df["extra/data/inf"].tolist() == [-math.inf] * 6
    assert df["extra/data/pair/0"].tolist() == STEPS
    # a scalar some steps lack is NaN there
    assert df["extra/data/late"].iloc[:3].isna().all() and df["extra/data/late"].iloc[3:].tolist() == [3, 4, 5]
    # the scheduler halves the lr every 2 steps; each param group has its own
    lr0 = [0.1 * 0.5 ** ((s + 1) // 2) for s in STEPS]
    assert df["optim/param_groups/0/lr"].tolist() == pytest.approx(lr0)
    assert df["optim/param_groups/1/lr"].tolist() == pytest.approx([5 * v for v in lr0])
    assert df["extra/scheduler/_last_lr/0"].tolist() == pytest.approx(lr0)


def test_scalars_names_short_forms_and_globs(h):
    df = h.scalars(["loss", "optim/param_groups/*/lr", "extra/scheduler/gamma"])
    assert list(df.columns) == ["extra/data/loss", "optim/param_groups/0/lr", "optim/param_groups/1/lr",
                                "extra/scheduler/gamma"]
    assert list(h.scalars("pair/*").columns) == ["extra/data/pair/0", "extra/data/pair/1"]
    s = h.scalar("loss")
    assert s.name == "extra/data/loss" and s.index.name == "step"
    assert s.to_dict() == {step: loss_at(step) for step in STEPS}
    assert h.scalar("late").index.tolist() == [3, 4, 5]  # the steps that hold it
    with pytest.raises(KeyError) as err:
        h.scalar("los")
    assert err.value.args[0] == f"no scalar 'los' in {h.path}; close names: extra/data/loss"
    with pytest.raises(KeyError) as err:
        h.scalars(["loss", "nothing*"])
    assert err.value.args[0] == f"no scalar matches 'nothing*' in {h.path}"


def test_the_index_holds_the_scalars_of_each_commit(h, monkeypatch):
    path = h.path
    conn = sqlite3.connect(index_path(path))
    rows = conn.execute("SELECT step, value FROM scalars WHERE name='extra/data/loss' ORDER BY step").fetchall()
    assert rows == [(s, loss_at(s)) for s in STEPS]
    assert conn.execute("SELECT value FROM scalars WHERE name='extra/data/nan'").fetchall() == [(None,)] * 6
    assert conn.execute("SELECT typeof(value) FROM scalars WHERE name='extra/data/ok'").fetchall() == [("integer",)] * 6
    assert conn.execute("SELECT value FROM meta WHERE key='scalars_from_step'").fetchone() == ("0",)
    conn.close()
    # so no manifest is read for them
    monkeypatch.setattr(Store, "open_step", lambda *a: pytest.fail("a manifest was read"))
    assert h.scalars()["extra/data/loss"].tolist() == [loss_at(s) for s in STEPS]


def forget_scalars(path):
    """The index as a version without scalars wrote it."""
    conn = sqlite3.connect(index_path(path))
    with conn:
        conn.execute("DROP TABLE scalars")
        conn.execute("DELETE FROM meta WHERE key='scalars_from_step'")
    conn.close()


def test_a_run_written_before_reads_its_scalars_from_the_manifests(tmp_path, backend):
    run = str(tmp_path / "run")
    model = build_run(run, backend, steps=[0, 1, 2])
    with dh.open(run) as h:
        want = h.scalars()
    forget_scalars(run)
    with dh.open(run) as h:
        assert h.scalars().equals(want)
    # a writer appending to it records its own steps; the old ones still come from their manifests
    build_run(run, backend, steps=[3, 4], model=model)
    conn = sqlite3.connect(index_path(run))
    assert conn.execute("SELECT DISTINCT step FROM scalars ORDER BY step").fetchall() == [(3,), (4,)]
    assert conn.execute("SELECT value FROM meta WHERE key='scalars_from_step'").fetchone() == ("3",)
    conn.close()
    with dh.open(run) as h:
        assert h.scalars().index.tolist() == [0, 1, 2, 3, 4]
        assert h.scalar("loss").tolist() == [loss_at(s) for s in [0, 1, 2, 3, 4]]
        assert h.scalars().loc[[0, 1, 2], want.columns].equals(want)  # "late" begins at step 3


def test_a_rebuilt_index_holds_the_scalars(tmp_path):
    from datastates_hist.repair import repair_run

    run = str(tmp_path / "run")
    build_run(run, steps=[0, 1, 2])
    with dh.open(run) as h:
        want = h.scalars()
    repair_run(run, force=True)
    with dh.open(run) as h:
        assert h.store.index.scalars_from() == 0  # recorded by the repair, as the commits did
        assert h.scalars().equals(want)


def test_pruned_steps_take_their_scalars_along(tmp_path):
    run = str(tmp_path / "run")
    build_run(run, codec="key")  # no delta bases: the rule alone decides
    with dh.Checkpointer(run) as ckpt:
        ckpt.prune(keep_last=2)
    with dh.open(run) as h:
        assert h.scalar("loss").index.tolist() == [4, 5]
    conn = sqlite3.connect(index_path(run))
    assert conn.execute("SELECT DISTINCT step FROM scalars ORDER BY step").fetchall() == [(4,), (5,)]
    conn.close()


def test_trace_gives_scalars_and_tensor_statistics_side_by_side(h):
    df = h.trace(["loss", "0.weight", "optim/param_groups/0/lr"])
    assert list(df.columns) == ["extra/data/loss", "model/0.weight", "optim/param_groups/0/lr"]
    assert df.attrs["tensors"] == ["model/0.weight"]
    assert df["extra/data/loss"].tolist() == [loss_at(s) for s in STEPS]
    assert df["model/0.weight"].tolist() == h.stats("0.weight")["norm"].tolist()
    df = h.trace(["late", "1.*"], stat="max")  # globs; every series over the same steps
    assert list(df.columns) == ["extra/data/late", "model/1.bias", "model/1.weight"]
    assert df.index.tolist() == STEPS and df["extra/data/late"].iloc[:3].isna().all()
    assert df["model/1.bias"].tolist() == h.stats("1.bias")["max"].tolist()
    with pytest.raises(KeyError) as err:
        h.trace(["loss", "0.weigth"])
    assert err.value.args[0] == f"no tensor '0.weigth' in {h.path}, nor a scalar; close names: model/0.weight, model/1.weight"


def test_scalars_in_xarray(h, tmp_path):
    path = h.path
    xr = pytest.importorskip("xarray")
    da = h.to_xarray("loss")
    assert da.dims == ("step",) and da.name == "extra/data/loss" and da.attrs == {"long_name": "extra/data/loss"}
    assert da.values.tolist() == [loss_at(s) for s in STEPS]
    assert h.to_xarray("late").step.values.tolist() == [3, 4, 5]
    assert h.to_xarray("loss", steps=slice(0, None, 2)).values.tolist() == [loss_at(s) for s in (0, 2, 4)]
    ds = xr.open_dataset(path, engine="datastates", names=["loss", "0.weight", "late"])
    assert set(ds.data_vars) == {"extra.data.loss", "model.0.weight", "extra.data.late"}
    assert ds["extra.data.loss"].dims == ("step",) and ds["extra.data.loss"].attrs == {"long_name": "extra/data/loss"}
    assert ds["extra.data.loss"].values.tolist() == [loss_at(s) for s in STEPS]
    assert np.isnan(ds["extra.data.late"].values[:3]).all()
    ds.close()
    # a token count past 32 bits exports to netCDF3 (no 64-bit integers) as float64
    ds = xr.open_dataset(path, engine="datastates", names=["tokens", "ok"])
    ds.to_netcdf(str(tmp_path / "s.nc"))
    with xr.open_dataset(str(tmp_path / "s.nc")) as back:
        assert back["extra.data.tokens"].values.tolist() == [10 ** 12 + s for s in STEPS]
        assert back["extra.data.ok"].values.tolist() == [1, 0, 1, 0, 1, 0]
    ds.close()


def test_cli_trace_of_a_scalar_and_of_several_names(h, tmp_path):
    path = h.path
    out = cli("trace", path, "loss")
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.strip().splitlines()]
    assert rows[:3] == [["step", "loss"], ["0", "2"], ["1", "1"]]
    assert rows[-1][0] == "loss:"
    out = cli("trace", path, "loss", "0.*", "--json", "--plot", str(tmp_path / "t.png"))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["steps"] == STEPS and list(data["series"]) == ["extra/data/loss", "model/0.bias", "model/0.weight"]
    assert data["series"]["extra/data/loss"] == [loss_at(s) for s in STEPS]
    assert data["series"]["model/0.bias"] == h.stats("0.bias")["norm"].tolist()
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = cli("trace", path, "loss", "0.weight")
    header = out.stdout.splitlines()[0].split()
    assert header == ["step", "loss", "0.weight", "norm"]


def test_cli_trace_of_an_unknown_name_names_the_closest(h):
    path = h.path
    out = cli("trace", path, "los")
    assert out.returncode == 3 and out.stdout == ""
    assert out.stderr == f"datastates-hist: no tensor 'los' in {path}, nor a scalar; close names: extra/data/loss\n"
    out = cli("trace", path, "nothing*")
    assert out.returncode == 3
    assert out.stderr == f"datastates-hist: no tensor matches 'nothing*' in {path}, nor a scalar\n"


def test_scalars_of_walks_the_encoded_values():
    items = {"rng/torch": [1, 2, 3], "extra/s": {"type": "X", "state": {"a": 1, "b": {"__float__": "inf"}}},
             "optim/param_groups": {"type": "Adam", "groups": [{"params": ["w"], "options": {"lr": 0.1,
                                                               "betas": {"__tuple__": [0.9, 0.99]}}}]},
             "extra/t": {"__tensor__": "extra/t"}, "extra/d": {"__dict__": [[1, 2.5], [[1, 2], 3]]}}
    assert scalars_of(items) == {"extra/s/a": 1, "extra/s/b": math.inf, "optim/param_groups/0/lr": 0.1,
                                 "optim/param_groups/0/betas/0": 0.9, "optim/param_groups/0/betas/1": 0.99,
                                 "extra/d/1": 2.5}
