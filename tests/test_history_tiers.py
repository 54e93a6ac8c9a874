"""Kinds of step, retention while training, and delta chains across what can go wrong in a run:
a failed step, a tensor that changes shape, a new session, policies added to an older run."""

import os
import sqlite3

import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist.retention import Policy


def rows(run, sql, args=()):
    conn = sqlite3.connect(f"{run}/index.sqlite")
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def encodings(run, name):
    return {step: (enc, base) for step, enc, base in
            rows(run, "SELECT step, encoding, base FROM tensors WHERE name=? ORDER BY step", (name,))}


class Trainer:
    """A small model trained with AdamW; every written step's weights kept to compare."""

    def __init__(self, seed=0, width=24):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.written = {}

    def step(self):
        loss = self.model(torch.randn(16, self.model[0].in_features)).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()

    def write(self, ckpt, step, **extra):
        loss = self.step()
        ckpt.write(step, self.model, self.opt, data={"loss": loss}, **extra)
        self.written[step] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def check_reads(self, run, steps=None):
        with dh.open(run) as h:
            for step in steps if steps is not None else h.steps:
                for name, value in self.written[step].items():
                    assert torch.equal(h.read(name, step), value), (step, name)


@pytest.mark.parametrize("backend", ["adios2", "hdf5"])
def test_a_failed_step_restarts_every_chain_with_a_key(tmp_path, backend):
    run = str(tmp_path / "run")
    t = Trainer()
    with dh.Checkpointer(run, backend=backend, refuse_nonfinite=True) as ckpt:
        for step in range(3):
            t.write(ckpt, step)
        ckpt.wait()
        ckpt.write(3, t.model, t.opt, bad=torch.tensor([float("nan")]))  # fails in the flusher
        with pytest.raises(dh.CheckpointError, match="step 3 .* failed and was not committed"):
            ckpt.wait()
        for step in range(4, 7):
            t.write(ckpt, step)
    assert encodings(run, "model/0.weight") == {0: ("key", None), 1: ("delta", 0), 2: ("delta", 1),
                                                4: ("key", None), 5: ("delta", 4), 6: ("delta", 5)}
    t.check_reads(run)


def trained(tmp_path, steps, **options):
    """A run of ``steps`` steps written with ``options``, and its Trainer."""
    run, t = str(tmp_path / "run"), Trainer()
    with dh.Checkpointer(run, **options) as ckpt:
        for step in range(steps):
            t.write(ckpt, step)
    return run, t


def test_the_second_base_is_the_base_of_the_first(tmp_path):
    run, t = trained(tmp_path, 7, key_every=4)
    with dh.open(run) as h:
        data = h.store.open_step(5)
        rec = data.records["model/0.weight"]
        data.close()
    assert (rec.encoding, rec.base, rec.base2) == ("delta", 4, None)  # 4 is a key (every 4 anchors)
    assert encodings(run, "model/0.weight") == {0: ("key", None), 1: ("delta", 0), 2: ("delta", 1),
                                                3: ("delta", 2), 4: ("key", None), 5: ("delta", 4),
                                                6: ("delta", 5)}
    with dh.open(run) as h:
        data = h.store.open_step(3)
        assert (data.records["model/0.weight"].base, data.records["model/0.weight"].base2) == (2, 1)
        data.close()
    t.check_reads(run)


def test_a_tensor_that_changes_shape_is_stored_as_a_key(tmp_path):
    run = str(tmp_path / "run")
    with dh.Checkpointer(run) as ckpt:
        m = torch.nn.Linear(2, 2)
        for step, size in enumerate([5, 5, 7, 7]):
            ckpt.write(step, m, buffer=torch.arange(size, dtype=torch.float32) * (step + 1))
    assert encodings(run, "extra/buffer") == {0: ("key", None), 1: ("delta", 0), 2: ("key", None),
                                              3: ("delta", 2)}
    with dh.open(run) as h:
        assert torch.equal(h.read("extra/buffer", 3), torch.arange(7, dtype=torch.float32) * 4)


def test_a_new_session_starts_with_keys_and_reads_the_old_chains(tmp_path):
    run, t = trained(tmp_path, 3)
    with dh.Checkpointer(run) as ckpt:
        for step in range(3, 5):
            t.write(ckpt, step)
    assert encodings(run, "model/2.bias") == {0: ("key", None), 1: ("delta", 0), 2: ("delta", 1),
                                              3: ("key", None), 4: ("delta", 3)}
    t.check_reads(run)


@pytest.mark.parametrize("backend", ["adios2", "hdf5"])
def test_steps_off_the_trajectory_grid_go_and_grid_steps_stay(tmp_path, backend):
    run = str(tmp_path / "run")
    t = Trainer()
    with dh.Checkpointer(run, backend=backend, keep=dh.KeepLast(2),
                         trajectory=dh.Trajectory("model/*", every=3)) as ckpt:
        for step in range(10):
            t.write(ckpt, step)
    assert rows(run, "SELECT step, tier FROM steps ORDER BY step") == [
        (0, "trajectory"), (3, "trajectory"), (6, "trajectory"), (8, "restore"), (9, "restore")]
    suffix = ".h5" if backend == "hdf5" else ".bp"
    assert sorted(os.listdir(f"{run}/steps")) == sorted(
        [f"{s:012d}{suffix}" for s in (0, 3, 6, 8, 9)] + [f"{s:012d}.restore{suffix}" for s in (8, 9)])
    # grid steps are deltas against the grid's anchors; off-grid steps, removed once let go, are raw
    assert {s: e for s, e in encodings(run, "model/0.weight").items()} == {
        0: ("key", None), 3: ("delta", 0), 6: ("delta", 3), 8: ("raw", None), 9: ("delta", 6)}
    t.check_reads(run)
    with dh.open(run) as h:
        assert h.steps == [0, 3, 6, 8, 9] and h.restore_points == [8, 9]
        assert h.scalars()["extra/data/loss"].notna().all()  # the values stay with trajectory points
        with pytest.raises(KeyError) as info:
            h.read("optim/state/0.weight/exp_avg", 3)
        assert info.value.args[0] == (f"no tensor 'optim/state/0.weight/exp_avg' in step 3 of {run}: it is a trajectory "
                                      "point, which keeps only the trajectory's tensors; the nearest restore point "
                                      "is step 8")


def test_policies_added_to_an_older_run_keep_its_single_unit_steps(tmp_path):
    run, t = trained(tmp_path, 3)  # every step a restore point of one unit
    with dh.Checkpointer(run, keep=dh.KeepLast(1), trajectory=dh.Trajectory("model/*", every=2)) as ckpt:
        for step in range(3, 6):
            t.write(ckpt, step)
    # 0 and 2 are on the grid but of one unit: they cannot drop their optimizer state, so they stay
    # restore points; 1 is off the grid but the delta base of 2, so it stays too; 3 goes; 4 is
    # demoted; 5 is the newest
    assert rows(run, "SELECT step, tier FROM steps ORDER BY step") == [
        (0, "full"), (1, "full"), (2, "full"), (4, "trajectory"), (5, "restore")]
    t.check_reads(run)


def test_a_restore_point_restores_bit_exact_and_a_trajectory_point_says_where_to_go(tmp_path):
    run = str(tmp_path / "run")
    t = Trainer()
    with dh.Checkpointer(run, keep=dh.KeepLast(1) | dh.KeepEvery(4), trajectory=dh.Trajectory()) as ckpt:
        for step in range(7):
            t.write(ckpt, step)
        optim_state = {k: v.clone() for k, v in t.opt.state_dict()["state"][0].items()}
    fresh = Trainer(seed=1)
    with dh.Checkpointer(run) as ckpt:
        restored = ckpt.restore(model=fresh.model, optimizer=fresh.opt)
        assert restored.step == 6
        for name, value in t.written[6].items():
            assert torch.equal(fresh.model.state_dict()[name], value)
        for key, value in optim_state.items():
            assert torch.equal(fresh.opt.state_dict()["state"][0][key], value)
        with pytest.raises(dh.StepNotFoundError) as err:
            ckpt.restore(5, model=fresh.model, optimizer=fresh.opt)
        assert str(err.value) == (
            f"step 5 of {run} is a trajectory point, not a restore point: it keeps 4 tensor(s) to read, not "
            "the whole state. The nearest restore points: 4 and 6; restore(step, strict=False) loads what it "
            "has and lists the rest")
        partial = ckpt.restore(5, model=fresh.model, optimizer=fresh.opt, strict=False)
    for name, value in t.written[5].items():
        assert torch.equal(fresh.model.state_dict()[name], value)
    # the optimizer's state was in the restore unit: reported missing and left as it was (step 6's)
    assert partial.problems.missing == ["optim", "rng"] and not partial.rng
    for key, value in optim_state.items():
        assert torch.equal(fresh.opt.state_dict()["state"][0][key], value)


@pytest.mark.parametrize("backend", ["adios2", "hdf5"])
def test_extras_whose_tensors_went_with_the_restore_unit_are_listed_missing_not_rebuilt(tmp_path, backend):
    """restore(strict=False) of a trajectory point: an extra not passed whose tensors were in
    the restore unit (a tensor, an array, a module, an optimizer) is missing; the plain ones
    come back. It failed as damage ("refers to tensor '', which was not loaded")."""
    run = str(tmp_path / "run")
    model, disc = torch.nn.Linear(2, 2), torch.nn.Linear(3, 1)
    disc_opt = torch.optim.Adam(disc.parameters())
    disc(torch.ones(1, 3)).sum().backward()
    disc_opt.step()
    with dh.Checkpointer(run, backend=backend, keep=dh.KeepLast(1), trajectory=dh.Trajectory("model/*")) as ckpt:
        for step in range(3):
            ckpt.write(step, model, t=torch.full((3,), float(step)), a=np.full(2, step, dtype=np.float32),
                       disc=disc, disc_opt=disc_opt, data={"epoch": step})
    with dh.Checkpointer(run) as ckpt:
        restored = ckpt.restore(0, model=torch.nn.Linear(2, 2), strict=False)
    assert sorted(restored.problems.missing) == ["extra/a", "extra/disc", "extra/disc_opt", "extra/t", "rng"]
    assert restored.extra == {"data": {"epoch": 0}}
    with dh.Checkpointer(run) as ckpt:  # a restore point: every extra rebuilt
        restored = ckpt.restore(2, model=torch.nn.Linear(2, 2))
    assert torch.equal(restored.extra["t"], torch.full((3,), 2.0)) and restored.extra["a"].tolist() == [2.0, 2.0]
    assert torch.equal(restored.extra["disc"]["weight"], disc.weight.detach())


class NewestOnly(Policy):
    """A policy of the user's own: it cannot say which steps it keeps for good."""

    def keep(self, steps):
        return set(steps[-1:])


@pytest.mark.parametrize("backend", ["adios2", "hdf5"])
def test_what_retention_will_let_go_is_stored_raw_and_what_stays_is_compressed(tmp_path, backend):
    run = str(tmp_path / "run")
    t = Trainer()
    with dh.Checkpointer(run, backend=backend, keep=dh.KeepLast(2) | dh.KeepEvery(4),
                         trajectory=dh.Trajectory("model/*")) as ckpt:
        for step in range(7):
            t.write(ckpt, step)
        optim_at_6 = {k: v.clone() for k, v in t.opt.state_dict()["state"][0].items()}
    # the restore units of 0 and 4 stay as long as the run: compressed; 5 and 6 go once two newer
    # steps come: raw. The trajectory's tensors stay in every step: compressed
    restore_unit = rows(run, "SELECT DISTINCT step, encoding FROM tensors WHERE part='restore' ORDER BY step")
    assert restore_unit == [(0, "key"), (4, "key"), (5, "raw"), (6, "raw")]
    assert encodings(run, "model/0.weight") == {0: ("key", None), **{s: ("delta", s - 1) for s in range(1, 7)}}
    t.check_reads(run)
    fresh = Trainer(seed=1)
    with dh.Checkpointer(run) as ckpt:
        assert ckpt.restore(model=fresh.model, optimizer=fresh.opt).step == 6
    for key, value in optim_at_6.items():
        assert torch.equal(fresh.opt.state_dict()["state"][0][key], value)

    # without a trajectory a step that goes is stored raw whole; a policy that cannot tell compresses
    for keep, expected in [(dh.KeepLast(1) | dh.KeepEvery(3), {0: "key", 3: "key", 4: "raw"}),
                           (NewestOnly(), {4: "key"})]:
        other = str(tmp_path / type(keep).__name__)
        with dh.Checkpointer(other, backend=backend, keep=keep) as ckpt:
            for step in range(5):
                t.write(ckpt, step)
        assert {s: e for s, (e, _) in encodings(other, "model/0.weight").items()} == expected
        assert {e for (e,) in rows(other, "SELECT DISTINCT encoding FROM tensors WHERE step=4")} == {
            expected[4]}


def test_a_retention_failure_keeps_the_steps_and_warns(tmp_path):
    run = str(tmp_path / "run")
    t = Trainer()
    with dh.Checkpointer(run, keep=dh.KeepLast(1), codec="key") as ckpt:
        t.write(ckpt, 0)
        ckpt.wait()
        conn = sqlite3.connect(f"{run}/index.sqlite")
        with conn:  # a crafted location: retention refuses to touch it
            conn.execute("UPDATE steps SET location='../../elsewhere.bp' WHERE step=0")
        conn.close()
        with pytest.warns(RuntimeWarning, match=r"retention after step 1 in .* failed, older steps are kept: "
                                                r"CorruptionError: the index row of step 0"):
            t.write(ckpt, 1)
            ckpt.wait()
    assert [r[0] for r in rows(run, "SELECT step FROM steps ORDER BY step")] == [0, 1]


def test_steps_written_after_a_truncate_do_not_build_on_the_truncated_ones(tmp_path):
    run = str(tmp_path / "run")
    t = Trainer()
    with dh.Checkpointer(run, key_every=100) as ckpt:
        for step in range(6):
            t.write(ckpt, step)
        assert ckpt.truncate(after=2) == [3, 4, 5]  # 5 was the newest anchor, 4 its base
        for step in range(3, 5):
            t.write(ckpt, step)
    assert encodings(run, "model/0.weight") == {0: ("key", None), 1: ("delta", 0), 2: ("delta", 1),
                                                3: ("key", None), 4: ("delta", 3)}
    t.check_reads(run)


def test_a_chain_longer_than_the_recursion_limit_reads_from_a_fresh_reader(tmp_path):
    run = str(tmp_path / "run")
    m = torch.nn.Linear(2, 2)
    with dh.Checkpointer(run, key_every=10_000) as ckpt:
        for step in range(1200):
            ckpt.write(step, m, w=torch.arange(8, dtype=torch.float32) + step)
    assert encodings(run, "extra/w")[1199] == ("delta", 1198)
    with dh.open(run) as h:
        assert torch.equal(h.read("extra/w", 1199), torch.arange(8, dtype=torch.float32) + 1199)


def test_a_partial_trajectory_restores_the_model_tensors_it_has(tmp_path):
    run, t = trained(tmp_path, 3, keep=dh.KeepLast(1), trajectory=dh.Trajectory("model/0.weight"))
    fresh = Trainer(seed=1)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with dh.Checkpointer(run) as ckpt:
        partial = ckpt.restore(1, model=fresh.model, optimizer=fresh.opt, strict=False)
    assert partial.problems.missing == ["model/0.bias", "model/2.weight", "model/2.bias", "optim", "rng"]
    got = fresh.model.state_dict()
    assert torch.equal(got["0.weight"], t.written[1]["0.weight"])
    for name in ("0.bias", "2.weight", "2.bias"):  # not in the trajectory point: left as they were
        assert torch.equal(got[name], before[name])


@pytest.mark.parametrize("how", ["api", "cli"])
def test_prune_keeps_the_newest_restore_point_after_a_truncate_onto_a_trajectory_point(tmp_path, how):
    """A truncate() onto a trajectory point leaves a newest step that restores nothing:
    prune keeps the newest restore point still, so the run stays restorable."""
    import json
    import subprocess
    import sys

    run, t = str(tmp_path / "run"), Trainer()
    with dh.Checkpointer(run, keep=dh.KeepLast(2) | dh.KeepEvery(4),
                         trajectory=dh.Trajectory("model/*", every=2), codec="key") as ckpt:
        for step in range(10):
            t.write(ckpt, step)
        ckpt.truncate(after=6)
        with dh.open(run) as h:
            assert (h.steps, h.restore_points) == ([0, 2, 4, 6], [0, 4])
        if how == "api":
            assert ckpt.prune(keep_last=1) == [0, 2]
    if how == "cli":
        said = subprocess.run([sys.executable, "-m", "datastates_hist.cli", "prune", run, "--keep-last", "1",
                               "--dry-run"], capture_output=True, text=True).stdout.splitlines()
        assert said[0].startswith("would delete 2 steps; 2 kept; would free ") and said[0].endswith("(steps 0, 2)")
        assert said[1:] == ["step 4 kept: the newest restore point (no rule keeps it)"]
        out = subprocess.run([sys.executable, "-m", "datastates_hist.cli", "prune", run, "--keep-last", "1", "--json"],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert {k: v for k, v in json.loads(out.stdout).items() if k in ("removed", "kept", "kept_restore_point")} == {
            "removed": [0, 2], "kept": [4, 6], "kept_restore_point": 4}
    with dh.open(run) as h:
        assert (h.steps, h.restore_points) == ([4, 6], [4])
    t.check_reads(run)
    with dh.Checkpointer(run) as ckpt:
        model = Trainer(seed=1).model
        assert ckpt.restore(model=model, strict=False).step == 4
        assert all(torch.equal(v, t.written[4][k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("first, then", [
    (dh.Trajectory("model/0.*"), dh.Trajectory("model/*")),  # a wider trajectory
    (dh.Trajectory("model/*", keep_bits=8), dh.Trajectory("model/*")),  # an exact one
])
def test_a_run_reopened_with_another_trajectory_keeps_what_that_trajectory_keeps(tmp_path, first, then):
    """Restore points of a first session that the second's policies let go: demoting one
    would drop tensors (or exact bits) the trajectory now in force keeps, so it stays whole."""
    run, t = str(tmp_path / "run"), Trainer()
    with dh.Checkpointer(run, keep=dh.KeepLast(1) | dh.KeepEvery(4), trajectory=first) as ckpt:
        for step in range(6):
            t.write(ckpt, step)
    with dh.open(run) as h:
        assert h.restore_points == [0, 4, 5]
    with dh.Checkpointer(run, keep=dh.KeepLast(1), trajectory=then) as ckpt:
        for step in range(6, 9):
            t.write(ckpt, step)
    with dh.open(run) as h:
        assert h.restore_points == [0, 4, 5, 8]
        assert h.steps == list(range(9))
        for step in (0, 4, 5):
            assert set(h.tensors(step)["name"]) >= {f"model/{k}" for k in t.written[step]}
    t.check_reads(run, [0, 4, 5, 6, 7, 8])  # exact
    with dh.Checkpointer(run) as ckpt:
        model = Trainer(seed=1).model
        ckpt.restore(4, model=model, strict=False)
        assert all(torch.equal(v, t.written[4][k]) for k, v in model.state_dict().items())


def test_a_lossy_trajectory_point_restored_with_strict_false_says_what_is_rounded(tmp_path):
    run, t = str(tmp_path / "run"), Trainer()
    with dh.Checkpointer(run, keep=dh.KeepLast(1), trajectory=dh.Trajectory("model/*", keep_bits=8)) as ckpt:
        for step in range(3):
            t.write(ckpt, step)
        model = Trainer(seed=1).model
        with pytest.warns(RuntimeWarning) as warned:
            restored = ckpt.restore(1, model=model, strict=False)
        names = [f"model/{k}" for k in t.written[1]]
        assert restored.rounded == {name: 8 for name in names}
        assert str(warned[0].message) == (
            f"datastates-hist: step 1 of {run} is a trajectory point that keeps 4 tensor(s) rounded to 8 mantissa "
            f"bits (relative error at most 2**-9): {', '.join(names[:3])} and 1 more loaded so, not exact")
        for k, v in model.state_dict().items():
            exact = t.written[1][k]
            assert not torch.equal(v, exact) and ((v - exact).abs() <= exact.abs() * 2 ** -9).all(), k
        assert ckpt.restore(2, model=model, strict=False).rounded == {}  # a restore point: exact
        assert all(torch.equal(v, t.written[2][k]) for k, v in model.state_dict().items())
