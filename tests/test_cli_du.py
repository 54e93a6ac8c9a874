"""``datastates-hist du``, run as a real subprocess on real runs (restore and trajectory
points, delta-encoded, raw): every figure checked against the index read with sqlite3
and the units' sizes on disk, the table's lines, its width, and its errors."""

import json
import os
import sqlite3

import pytest
import torch

import datastates_hist as dh
from datastates_hist.cli.output import size
from test_cli_managing import torch_imported_by, unit_sizes
from test_cli_reading import cli

STEPS = 10
RUNS = {
    "trajectory": dict(keep=dh.KeepLast(2) | dh.KeepEvery(4), trajectory=dh.Trajectory("model/*")),
    "delta": {},
    "raw": dict(codec="raw"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same training, checkpointed three ways."""
    made = {}
    for name, options in RUNS.items():
        made[name] = path = str(tmp_path_factory.mktemp("du") / name)
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        with dh.Checkpointer(path, **options) as ckpt:
            for step in range(STEPS):
                net(torch.randn(4, 32)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                ckpt.write(step, net, opt)
                ckpt.wait()
    return made


def from_index(run):
    """What du should say, summed here from the index's rows: by kind, group and encoding,
    ``[stored, raw]``."""
    conn = sqlite3.connect(f"file:{os.path.join(run, 'index.sqlite')}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT s.tier, t.name, t.encoding, COALESCE(t.stored, t.nbytes), t.nbytes"
                            " FROM tensors t JOIN steps s ON s.step = t.step").fetchall()
    finally:
        conn.close()
    want = {"kinds": {"restore": [0, 0], "trajectory": [0, 0]},
            "groups": {"model": [0, 0], "optimizer": [0, 0], "other": [0, 0]},
            "encodings": {"raw": [0, 0], "key": [0, 0], "delta": [0, 0]}}
    for tier, name, encoding, stored, nbytes in rows:
        group = "model" if name.startswith("model/") else "optimizer" if name.startswith("optim/") else "other"
        for by, key in (("kinds", "trajectory" if tier == "trajectory" else "restore"), ("groups", group),
                        ("encodings", encoding)):
            want[by][key][0] += stored
            want[by][key][1] += nbytes
    return want


def figures(stored, raw):
    return {"stored": stored, "raw": raw, "ratio": stored / raw if raw else None}


def du_json(run):
    out = cli("du", run, "--json")
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("name", list(RUNS))
def test_du_json_equals_the_index_and_the_units_on_disk(runs, name):
    run, want = runs[name], from_index(runs[name])
    got = du_json(run)
    stored, raw = map(sum, zip(*want["kinds"].values()))
    disk = sum(unit_sizes(run).values())
    assert got == {"run": run, "steps": STEPS,
                   **{by: {key: figures(*pair) for key, pair in parts.items()} for by, parts in want.items()},
                   "total": figures(stored, raw), "disk": disk, "metadata": disk - stored}
    for by in ("groups", "encodings"):
        assert sum(part["stored"] for part in got[by].values()) == stored
        assert sum(part["raw"] for part in got[by].values()) == raw


def test_du_tells_the_three_runs_apart(runs):
    trajectory, delta, raw = (du_json(runs[name]) for name in RUNS)
    assert raw["total"]["raw"] == delta["total"]["raw"] == raw["total"]["stored"] > delta["total"]["stored"]
    assert raw["encodings"]["raw"] == figures(raw["total"]["raw"], raw["total"]["raw"])
    assert raw["encodings"]["delta"] == raw["encodings"]["key"] == figures(0, 0)
    assert delta["kinds"]["trajectory"] == delta["encodings"]["raw"] == figures(0, 0)
    assert delta["encodings"]["delta"]["raw"] == delta["total"]["raw"] * (STEPS - 1) // STEPS  # step 0: a key
    # KeepLast(2) | KeepEvery(4) keeps 0, 4, 8, 9 whole; the other steps keep the model only
    model_step = trajectory["groups"]["model"]["raw"] // STEPS
    assert trajectory["kinds"]["trajectory"]["raw"] == 6 * model_step
    assert trajectory["kinds"]["restore"]["raw"] == 4 * delta["total"]["raw"] // STEPS
    # of the restore units, only step 9's is let go later (KeepEvery(4) keeps 0, 4 and 8): stored raw
    rest_of_a_step = delta["total"]["raw"] // STEPS - model_step
    assert trajectory["encodings"]["raw"] == figures(rest_of_a_step, rest_of_a_step)
    for run in (trajectory, delta):  # the restore units of the trajectory run hold the restore points' rest
        assert 0 < run["total"]["stored"] < run["total"]["raw"] and run["metadata"] > 0


def test_du_table_fits_80_columns_and_prints_every_figure(runs):
    run = runs["trajectory"]
    got = du_json(run)
    out = cli("du", run, columns=80)
    assert (out.returncode, out.stderr) == (0, "")
    lines = out.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    assert lines[0].split() == ["by", "what", "stored", "raw", "stored/raw"]

    def cells(part):
        return [size(part["stored"]), size(part["raw"]), f"{part['ratio']:.3f}"]

    assert [line.split() for line in lines[1:]] == [" ".join(row).split() for row in [
        ["kind", "restore points", *cells(got["kinds"]["restore"])],
        ["trajectory points", *cells(got["kinds"]["trajectory"])],
        ["group", "model", *cells(got["groups"]["model"])],
        ["optimizer", *cells(got["groups"]["optimizer"])],
        ["other", *cells(got["groups"]["other"])],
        ["encoding", "raw", *cells(got["encodings"]["raw"])],
        ["key", *cells(got["encodings"]["key"])],
        ["delta", *cells(got["encodings"]["delta"])],
        ["total", *cells(got["total"])],
        ["on disk", size(got["disk"]), f"{got['disk'] / got['total']['raw']:.3f}"],
        ["metadata", size(got["metadata"])],
    ]]
    delta = cli("du", runs["delta"], columns=80).stdout.splitlines()
    assert delta[6].split() == ["encoding", "raw", "0", "B", "0", "B"]  # a blank ratio: nothing raw-encoded


def test_du_of_a_missing_run_or_a_folder_that_is_not_one(tmp_path):
    out = cli("du", str(tmp_path / "missing"))
    assert (out.returncode, out.stdout, out.stderr) == (3, "", f"datastates-hist: no run at {tmp_path / 'missing'}\n")
    out = cli("du", str(tmp_path), "--json")
    assert (out.returncode, out.stdout) == (3, "")
    assert out.stderr == f"datastates-hist: {tmp_path} is not a datastates-hist run (no index.sqlite)\n"


def test_du_of_a_version_1_index_counts_every_tensor_raw(runs, tmp_path):
    """An index without the columns of version 2 (as version 1 wrote it): stored is nbytes."""
    import shutil

    run = str(tmp_path / "v1")
    shutil.copytree(runs["raw"], run)
    conn = sqlite3.connect(os.path.join(run, "index.sqlite"))
    with conn:
        for column in ("part", "stored", "base", "update_ratio"):
            conn.execute(f"ALTER TABLE tensors DROP COLUMN {column}")
        conn.execute("UPDATE meta SET value='1' WHERE key='format_version'")
    conn.close()
    got, want = du_json(run), du_json(runs["raw"])
    assert got == {**want, "run": run}


def test_du_counts_only_the_committed_units(runs, tmp_path):
    import shutil

    run = str(tmp_path / "run")
    shutil.copytree(runs["trajectory"], run)
    before = du_json(run)
    steps = os.path.join(run, "steps")
    os.mkdir(os.path.join(steps, "000000000042.bp.partial"))  # being written
    with open(os.path.join(steps, "000000000042.bp.partial", "data.0"), "wb") as f:
        f.write(b"x" * 1000)
    with open(os.path.join(steps, "000000000043.bp"), "wb") as f:  # a crash's leftover, not committed
        f.write(b"x" * 1000)
    assert du_json(run) == {**before, "run": run}


def test_du_does_not_import_torch(runs):
    run = runs["trajectory"]
    assert torch_imported_by(f"from datastates_hist.cli import main\nassert main(['du', {run!r}]) == 0") == "False"
