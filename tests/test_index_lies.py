"""A damaged index row that lies about its own step (its tier, its location) never gets
that step's data deleted: the next writer refuses to open, and repair brings every step
back. What a demotion cut short leaves is still cleaned up."""

import os
import sqlite3

import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist.index import Index
from datastates_hist.repair import repair_run
from restoring import assert_step_restores


def make_run(run_dir, backend):
    """Steps 0-5 with the quickstart's policies: 0, 4 and 5 restore points, the others trajectory points."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    with dh.Checkpointer(run_dir, backend=backend, keep=dh.KeepLast(2) | dh.KeepEvery(1000),
                         trajectory=dh.Trajectory("model/*")) as ckpt:
        for step in range(6):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            ckpt.write(step, model, opt)
    return model, opt


def units(run_dir):
    return sorted(os.listdir(os.path.join(run_dir, "steps")))


def edit_index(run_dir, sql, *args):
    conn = sqlite3.connect(os.path.join(run_dir, "index.sqlite"))
    with conn:
        conn.execute(sql, args)
    conn.close()


@pytest.mark.parametrize("tier", ["full", "trajectory"])
def test_a_restore_point_whose_tier_lies_keeps_its_restore_unit(tmp_path, backend, tier):
    run_dir = str(tmp_path / "run")
    model, opt = make_run(run_dir, backend)
    before = units(run_dir)
    restore = next(u for u in before if u.startswith("000000000005.restore"))
    edit_index(run_dir, "UPDATE steps SET tier=? WHERE step=5", tier)
    with pytest.raises(dh.CorruptionError) as caught:
        dh.Checkpointer(run_dir)
    main = restore.replace(".restore", "")
    assert str(caught.value) == (
        f"the index of {run_dir} says step 5 is a {tier} step stored as {main}, but {restore} of that step "
        "is there too (1 such unit(s)): the index is damaged, so they may be committed data; nothing was "
        f"changed. Rebuild the index with: datastates-hist repair {run_dir}")
    assert units(run_dir) == before
    report = repair_run(run_dir, force=True)
    assert report.steps == list(range(6)) and not report.set_aside
    assert_step_restores(run_dir, 5, model, opt)


def test_a_row_naming_other_data_gets_no_unit_of_its_step_deleted(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    model, opt = make_run(run_dir, backend)
    before = units(run_dir)
    edit_index(run_dir, "UPDATE steps SET location='000000000004.ranks' WHERE step=4")
    with pytest.raises(dh.CorruptionError, match=(
            rf"^the index of {run_dir} says step 4 is a restore step stored as 000000000004.ranks, but "
            r"000000000004\.\S+ of that step is there too \(2 such unit\(s\)\)")):
        dh.Checkpointer(run_dir)
    assert units(run_dir) == before
    report = repair_run(run_dir, force=True)
    assert report.steps == list(range(6)) and not report.set_aside
    assert_step_restores(run_dir, 5, model, opt)


def test_what_a_demotion_cut_short_leaves_is_removed(tmp_path, backend):
    """A demotion changes the index first (the rows of the restore unit go, the tier says
    trajectory), then deletes the unit: a crash between them leaves the unit, which the
    next writer deletes."""
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
    index = Index(run_dir, create=True)  # writable
    try:
        index.demote_step(4)  # the first half of retention.demote_steps
    finally:
        index.close()
    leftover = next(u for u in units(run_dir) if u.startswith("000000000004.restore"))
    with dh.Checkpointer(run_dir) as ckpt:
        assert ckpt.steps() == list(range(6))
    assert leftover not in units(run_dir)
    with dh.open(run_dir) as h:
        assert h.restore_points == [0, 5]


def test_a_rounded_trajectory_point_whose_row_says_whole_is_refused(tmp_path, backend):
    """A trajectory point keeps its weights rounded; a row that says the step is stored
    whole (one unit) would have them restored as exact."""
    from datastates_hist.verify import verify_run

    run_dir = str(tmp_path / "run")
    model = torch.nn.Linear(64, 16)
    with dh.Checkpointer(run_dir, backend=backend, keep=dh.KeepLast(1),
                         trajectory=dh.Trajectory("model/*", keep_bits=8)) as ckpt:
        for step in range(3):
            with torch.no_grad():
                model.weight.add_(0.01)
            ckpt.write(step, model)
    edit_index(run_dir, "UPDATE steps SET tier='full' WHERE step=1")
    expected = (f"the manifest of step 1 in {run_dir} is damaged: tensor 'model/weight' is rounded to 8 mantissa "
                "bits, but the index says the step is stored whole, in one unit: the index or the step's data "
                "is damaged")
    with dh.Checkpointer(run_dir) as ckpt, pytest.raises(dh.CorruptionError) as caught:
        ckpt.restore(1, model=torch.nn.Linear(64, 16), rng=False)
    assert str(caught.value) == expected
    problems = [(p.step, p.message) for p in verify_run(run_dir)]
    assert problems[0] == (1, f"its data cannot be opened: {expected}")
    assert problems[1:] and all(step == 2 and message.startswith("its delta base at step 1 cannot be read: ")
                                for step, message in problems[1:])  # the deltas against it


def test_prune_keeps_the_bases_the_manifests_name_when_the_index_says_otherwise(tmp_path, backend):
    """Prune keeps the delta bases of the steps that stay by the index's rows; rows of a
    kept step that say key where its manifest says delta (against step 4) would let its
    base go. The step reads as damaged, and prune deletes nothing."""
    run_dir = str(tmp_path / "run")
    model = torch.nn.Linear(8, 4)
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        for step in range(6):
            with torch.no_grad():
                model.weight.add_(0.01)
            ckpt.write(step, model)
    edit_index(run_dir, "UPDATE tensors SET encoding='key', base=NULL WHERE step=5")
    before = units(run_dir)
    with dh.open(run_dir) as h:
        first = next(iter(h.step_data(4).records))  # the first the manifest lists
    damaged = (f"step 5 in {run_dir}: tensor {first!r} is stored as key by the index but as delta against "
               "step 4 by the manifest: the index or the step's data is damaged")
    with dh.open(run_dir) as h, pytest.raises(dh.CorruptionError) as caught:
        h.read("weight", 5)
    assert str(caught.value) == damaged
    with dh.Checkpointer(run_dir) as ckpt, pytest.raises(dh.CorruptionError) as caught:
        ckpt.prune(keep_last=1)
    assert str(caught.value) == (f"nothing was pruned: step 5, which stays, cannot be checked: {damaged}; "
                                 f"check the run with: datastates-hist verify {run_dir}")
    assert units(run_dir) == before


@pytest.mark.parametrize("sql, what", [
    ("UPDATE tensors SET norm='big' WHERE step=3 AND name='model/weight'",
     "step 3: tensor 'model/weight' has malformed statistics: {'norm': 'big', "),
    ("UPDATE tensors SET update_ratio='fast' WHERE step=3 AND name='model/weight'",
     "step 3: tensor 'model/weight' has the update ratio fast, which is not a number or null"),
    ("UPDATE tensors SET nonfinite=-1 WHERE step=3 AND name='model/weight'",
     "step 3: tensor 'model/weight' has malformed statistics: {'norm': "),
    ("UPDATE steps SET time='yesterday' WHERE step=3", "(the row of step 3 holds (3, 'yesterday', "),
])
def test_statistics_that_are_no_numbers_are_named_as_damage_by_stats_and_trace(tmp_path, capsys, sql, what):
    """h.stats and h.trace read the index's statistics checked as show's records are:
    text where a number belongs is damage (CorruptionError, exit 4) naming the index, the
    step, the tensor and the column, never a column of text or a usage error."""
    from datastates_hist.cli import EXIT_DAMAGED, main

    run_dir = str(tmp_path / "run")
    make_run(run_dir, "adios2")
    edit_index(run_dir, sql)
    index = os.path.join(run_dir, "index.sqlite")
    with dh.open(run_dir) as h:
        for read in (lambda: h.stats("weight"), lambda: h.trace(["weight"]),
                     lambda: h.trace("weight", "update_ratio"), lambda: h.to_xarray("weight", steps=[])):
            with pytest.raises(dh.CorruptionError) as caught:
                read()
            message = str(caught.value)
            assert message.startswith(f"the index {index} is damaged") and what in message, message
            assert f"rebuild it from the step data with: datastates-hist repair {run_dir}" in message
        if sql.startswith("UPDATE tensors"):
            assert h.stats("bias")["norm"].dtype == np.float64  # the other tensor's rows are sound
    for stat in ("norm", "update_ratio"):
        assert main(["trace", run_dir, "weight", "--stat", stat]) == EXIT_DAMAGED
        out, err = capsys.readouterr()
        assert out == "" and err == f"datastates-hist: {message}\n"
    for side in ("", "-wal", "-shm"):
        if os.path.exists(index + side):
            os.remove(index + side)
    repair_run(run_dir)
    with dh.open(run_dir) as h:
        stats = h.stats("weight")
        assert list(stats.index) == list(range(6)) and all(t == np.float64 for t in stats.dtypes.drop("nonfinite"))
    assert main(["trace", run_dir, "weight"]) == 0
