"""`repair` records the scalars of each step it commits, as the commit did: after a
forced rebuild, the rebuild of a damaged index or of one written before the index held
scalars, ``h.scalars()`` and ``datastates-hist trace RUN loss`` give the values they
gave before, read from the index (no manifest is read)."""

from __future__ import annotations

import json
import math
import os
import sqlite3

import pytest
import torch

import datastates_hist as dh
from datastates_hist.durable import remove_tree
from datastates_hist.layout import index_path, step_stem, steps_dir
from datastates_hist.store import Store
from test_cli_managing import cli, copy_of

STEPS = range(8)
RESTORE_POINTS = [0, 3, 6, 7]  # KeepLast(2) | KeepEvery(3); the other steps keep the model only


def loss_at(step):
    return 3.0 / (1 + step)


def build_run(run_dir, backend):
    """Two param groups, a scheduler, and ``data=`` with a float, a large int, a bool and NaN."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}],
                            lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with dh.Checkpointer(run_dir, backend=backend, keep=dh.KeepLast(2) | dh.KeepEvery(3),
                         trajectory=dh.Trajectory("model/*")) as ckpt:
        for step in STEPS:
            model(torch.randn(3, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            ckpt.write(step, model, opt, scheduler=sched,
                       data={"loss": loss_at(step), "tokens": 10 ** 12 + step, "ok": step % 2 == 0,
                             "nan": math.nan})


@pytest.fixture
def run(tmp_path, backend, module_runs):
    """A copy of the module's run of ``backend``."""
    return copy_of(module_runs, backend, tmp_path)


def scalar_rows(run_dir):
    """Every row of the index's scalars table (with SQLite's type of each value), and
    where recording began."""
    conn = sqlite3.connect(f"file:{index_path(run_dir)}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT step, name, value, typeof(value) FROM scalars ORDER BY step, name").fetchall()
        start = conn.execute("SELECT value FROM meta WHERE key='scalars_from_step'").fetchall()
        return rows, start
    finally:
        conn.close()


def what_readers_see(run_dir):
    """``h.scalars()`` and the output of ``trace`` of the loss and the learning rates."""
    with dh.open(run_dir) as h:
        frame = h.scalars()
    out = cli("trace", run_dir, "loss", "optim/param_groups/*/lr", "--json")
    assert out.returncode == 0, out.stderr
    return frame, out.stdout


def assert_read_from_the_index(run_dir, monkeypatch, want_frame, want_trace):
    with monkeypatch.context() as patch:
        patch.setattr(Store, "open_step", lambda *a: pytest.fail("a manifest was read"))
        with dh.open(run_dir) as h:
            assert h.scalars().equals(want_frame)
    frame, trace = what_readers_see(run_dir)
    assert frame.equals(want_frame) and trace == want_trace


def test_the_run_holds_scalars_on_every_tier(run):
    rows, start = scalar_rows(run)
    assert start == [("0",)]
    loss = {(s, v) for s, n, v, _ in rows if n == "extra/data/loss"}
    assert loss == {(s, loss_at(s)) for s in STEPS}
    assert {(n, t) for _, n, _, t in rows if n.startswith("extra/data/")} == {
        ("extra/data/loss", "real"), ("extra/data/tokens", "integer"), ("extra/data/ok", "integer"),
        ("extra/data/nan", "null")}
    with dh.open(run) as h:
        assert h.restore_points == RESTORE_POINTS
        assert h.scalar("optim/param_groups/1/lr").tolist() == [0.5, 0.25, 0.25, 0.125, 0.125, 0.0625, 0.0625,
                                                                 0.03125]


def test_a_forced_repair_records_the_scalars_as_the_commits_did(run, monkeypatch):
    written, (frame, trace) = scalar_rows(run), what_readers_see(run)
    out = cli("repair", run, "--force")
    assert out.returncode == 0, out.stderr
    assert scalar_rows(run) == written
    assert_read_from_the_index(run, monkeypatch, frame, trace)
    assert json.loads(trace)["series"]["extra/data/loss"] == [loss_at(s) for s in STEPS]


def test_a_damaged_index_is_rebuilt_with_its_scalars(run, monkeypatch):
    written, (frame, trace) = scalar_rows(run), what_readers_see(run)
    with open(index_path(run), "r+b") as f:
        f.write(b"not an SQLite database" * 8)
    out = cli("repair", run)
    assert out.returncode == 0, out.stderr
    assert scalar_rows(run) == written
    assert_read_from_the_index(run, monkeypatch, frame, trace)


def test_an_index_written_before_it_held_scalars_gains_them(run, monkeypatch):
    written, (frame, trace) = scalar_rows(run), what_readers_see(run)
    conn = sqlite3.connect(index_path(run))
    with conn:  # the index as a version without scalars wrote it
        conn.execute("DROP TABLE scalars")
        conn.execute("DELETE FROM meta WHERE key='scalars_from_step'")
    conn.close()
    out = cli("repair", run, "--force")
    assert out.returncode == 0, out.stderr
    assert scalar_rows(run) == written
    assert_read_from_the_index(run, monkeypatch, frame, trace)


def test_a_step_whose_data_is_lost_loses_its_scalars_alone(run, monkeypatch):
    written, (frame, _) = scalar_rows(run), what_readers_see(run)
    lost = STEPS[-1]  # a restore point: both its units go; no delta needs them
    for unit in os.listdir(steps_dir(run)):
        if unit.startswith(step_stem(lost) + "."):
            remove_tree(os.path.join(steps_dir(run), unit))
    out = cli("repair", run)
    assert out.returncode == 0, out.stderr
    assert scalar_rows(run) == ([r for r in written[0] if r[0] != lost], written[1])
    _, trace = what_readers_see(run)
    assert_read_from_the_index(run, monkeypatch, frame.drop(index=lost), trace)
    assert json.loads(trace)["series"]["extra/data/loss"] == [loss_at(s) for s in STEPS if s != lost]
