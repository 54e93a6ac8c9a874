"""diff, trace, export and prune on the command line, checked against numpy."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist.store import Store


def cli(*args):
    return subprocess.run([sys.executable, "-m", "datastates_hist.cli", *args],
                          capture_output=True, text=True)


def train_run(run_dir, steps=6, backend="adios2", seed=0, codec="delta"):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    with dh.Checkpointer(run_dir, backend=backend, codec=codec) as ckpt:
        for step in range(steps):
            model(torch.randn(4, 6)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.write(step, model, opt)
    return model


def stored(run_dir, step, name):
    store = Store(run_dir)
    with store.open_step(step) as data:
        t = data.read(name)
    store.close()
    return t.numpy().astype(np.float64)


def test_diff_metrics_equal_numpy(run_dir, backend):
    train_run(run_dir, backend=backend)
    out = cli("diff", run_dir, "1", "4", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert not any(n.startswith("rng/") for n in rows)
    assert "model/0.weight" in rows and "optim/state/0.weight/exp_avg" in rows
    for name in ("model/0.weight", "model/2.bias", "optim/state/0.weight/exp_avg_sq"):
        a, b = stored(run_dir, 1, name), stored(run_dir, 4, name)
        d = b - a
        r = rows[name]
        assert r["l2"] == pytest.approx(np.linalg.norm(d), rel=1e-12)
        assert r["rel_l2"] == pytest.approx(np.linalg.norm(d) / np.linalg.norm(a), rel=1e-12)
        assert r["max_abs"] == pytest.approx(np.abs(d).max(), rel=1e-12)
        cos = (a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b))
        assert r["cosine"] == pytest.approx(cos, rel=1e-12)
        assert r["frac_changed"] == pytest.approx((a != b).mean())


def test_diff_sort_top_names_and_two_runs(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train_run(a, seed=0)
    train_run(b, seed=1)
    out = cli("diff", a, "0", "5", "--names", "0.*", "--sort", "max_abs", "--top", "1", "--json")
    rows = json.loads(out.stdout)
    assert len(rows) == 1 and rows[0]["name"] in ("model/0.weight", "model/0.bias")
    both = [abs(stored(a, 5, n) - stored(a, 0, n)).max() for n in ("model/0.weight", "model/0.bias")]
    assert rows[0]["max_abs"] == pytest.approx(max(both))
    out = cli("diff", f"{a}:5", f"{b}:5", "--names", "model/2.weight", "--json")
    (row,) = json.loads(out.stdout)
    want = np.linalg.norm(stored(b, 5, "model/2.weight") - stored(a, 5, "model/2.weight"))
    assert row["l2"] == pytest.approx(want, rel=1e-12)
    out = cli("diff", a, "0")
    assert out.returncode == 2 and "diff takes RUN A B or RUN_A:STEP RUN_B:STEP" in out.stderr
    out = cli("diff", a, "0", "5", "--names", "nothing*")
    assert out.returncode == 3 and "no tensor matches nothing*" in out.stderr


def test_trace_values_sparkline_and_plot(run_dir, tmp_path):
    train_run(run_dir)
    out = cli("trace", run_dir, "0.weight", "--json")
    data = json.loads(out.stdout)
    assert data["name"] == "model/0.weight" and data["steps"] == list(range(6))
    for step, value in zip(data["steps"], data["values"]):
        assert value == pytest.approx(np.linalg.norm(stored(run_dir, step, "model/0.weight")), rel=1e-6)
    out = cli("trace", run_dir, "0.weight", "--stat", "max", "--plot", str(tmp_path / "p.png"))
    assert out.returncode == 0, out.stderr
    assert "\n0.weight max: " in out.stdout and len(out.stdout.strip().splitlines()) == 8
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = cli("trace", run_dir, "no.such")
    assert out.returncode == 3 and "no tensor 'no.such'" in out.stderr


def test_export_safetensors_and_torch(run_dir, tmp_path):
    model = train_run(run_dir)
    st = str(tmp_path / "m.safetensors")
    out = cli("export", run_dir, "5", "--to", st)
    assert out.returncode == 0, out.stderr
    from safetensors.torch import load_file

    loaded = load_file(st)
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    fresh.load_state_dict(loaded)
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters()))
    pt = str(tmp_path / "all.pt")
    assert cli("export", run_dir, "5", "--to", pt, "--all").returncode == 0
    every = torch.load(pt, weights_only=True)
    assert "optim/state/0.weight/exp_avg" in every and "rng/torch" in every


def test_prune_keeps_what_the_rules_keep(run_dir):
    train_run(run_dir, steps=12, codec="key")  # no delta bases: the rules alone decide
    out = cli("prune", run_dir, "--keep-last", "2", "--keep-every", "5", "--dry-run", "--json")
    assert json.loads(out.stdout)["removed"] == [1, 2, 3, 4, 6, 7, 8, 9]
    assert len(os.listdir(os.path.join(run_dir, "steps"))) == 12
    out = cli("prune", run_dir, "--keep-last", "2", "--keep-every", "5")
    assert out.returncode == 0 and "deleted 8 steps; 4 kept" in out.stdout
    with dh.open(run_dir) as h:
        assert h.steps == [0, 5, 10, 11]
    assert len(os.listdir(os.path.join(run_dir, "steps"))) == 4
    out = cli("prune", run_dir)
    assert out.returncode == 2 and "say what to keep" in out.stderr


def test_prune_refuses_while_a_writer_runs(run_dir):
    train_run(run_dir)
    with dh.Checkpointer(run_dir):
        out = cli("prune", run_dir, "--keep-last", "1")
    assert out.returncode == 5 and "is being written by pid" in out.stderr
