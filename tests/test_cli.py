"""The datastates-hist command line, run as a real subprocess."""

import json
import subprocess
import sys

import numpy as np
import torch

import datastates_hist as dh
from datastates_hist.store import Store


def cli(*args):
    return subprocess.run([sys.executable, "-m", "datastates_hist.cli", *args],
                          capture_output=True, text=True)


def make_run(run_dir, backend="adios2"):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        for step in (0, 10, 20):
            ckpt.wait_snapshot()
            with torch.no_grad():
                model.weight.mul_(2)
            ckpt.write(step, model)
    return model


def test_ls_json_lists_committed_steps(run_dir, backend):
    make_run(run_dir, backend)
    out = cli("ls", run_dir, "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["step"] for r in rows] == [0, 10, 20]
    assert all(r["backend"] == backend and r["tensors"] == 3 for r in rows)
    assert rows[0]["bytes"] == (8 * 4 + 4) * 4 + 5056  # weight, bias, torch RNG state


def test_show_figures_equal_numpy_on_the_stored_tensor(run_dir):
    make_run(run_dir)
    out = cli("show", run_dir, "20", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    store = Store(run_dir)
    with store.open_step(20) as data:
        w = data.read("model/weight").numpy().astype(np.float64)
    store.close()
    row = rows["model/weight"]
    assert row["shape"] == [4, 8] and row["dtype"] == "float32"
    assert np.isclose(row["norm"], np.linalg.norm(w), rtol=1e-6)
    assert (row["min"], row["max"]) == (w.min(), w.max())
    assert np.isclose(row["mean"], w.mean(), atol=1e-7) and np.isclose(row["std"], w.std(), rtol=1e-5)


def test_table_output(run_dir):
    make_run(run_dir)
    out = cli("show", run_dir, "10")
    assert out.returncode == 0
    header, *lines = [line.split() for line in out.stdout.strip().splitlines()]
    assert header == ["name", "shape", "dtype", "encoding", "nbytes", "stored", "norm"]
    assert ["model/weight", "4x8", "float32"] == lines[[l[0] for l in lines].index("model/weight")][:3]
    out = cli("ls", run_dir)
    assert [l.split()[0] for l in out.stdout.strip().splitlines()] == ["step", "0", "10", "20"]


def test_errors_and_exit_codes(run_dir, tmp_path):
    make_run(run_dir)
    out = cli("show", run_dir, "5")
    assert out.returncode == 3 and "step 5 is not committed" in out.stderr
    out = cli("ls", str(tmp_path / "missing"))
    assert out.returncode == 3 and "no run at" in out.stderr
    out = cli("show", run_dir)
    assert out.returncode == 2 and "step" in out.stderr
