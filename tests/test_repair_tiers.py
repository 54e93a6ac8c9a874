"""`repair` and `verify` on runs of restore points, trajectory points and encoded tensors.

A run written with ``keep=`` and ``trajectory=`` stores each step as two units
(its main unit with the model's tensors, its restore unit with the rest) and
encodes the model's tensors as deltas against the step before. Its index is
deleted and rebuilt from the units: the rows come back as written, trajectory
points read bit for bit, the newest restore point restores bit for bit. A
missing or foreign restore unit, a restore unit without its main unit and a
delta without its base are each repaired or set aside with their reason, and
``verify`` names a damaged encoded tensor.
"""

from __future__ import annotations

import copy
import os
import shutil
import sqlite3

import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist.backends import get_backend
from datastates_hist.durable import remove_tree
from datastates_hist.layout import index_path, restore_unit, step_stem, steps_dir
from datastates_hist.repair import repair_run
from datastates_hist.verify import Problem, verify_run

STEPS = 10
RESTORE_POINTS = [0, 4, 8, 9]  # KeepLast(2) | KeepEvery(4) of steps 0..9
MODEL_TENSORS = ["model/0.weight", "model/0.bias", "model/2.weight", "model/2.bias"]
SAVED: dict[str, dict] = {}  # run_dir -> {"model": {step: state dict}, "optim": the last optimizer state}


def fresh_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def build_run(run_dir: str, backend: str) -> None:
    model = fresh_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    saved = SAVED[run_dir] = {"model": {}}
    with dh.Checkpointer(run_dir, keep=dh.KeepLast(2) | dh.KeepEvery(4), trajectory=dh.Trajectory("model/*"),
                         backend=backend) as ckpt:
        for step in range(STEPS):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ckpt.write(step, model, optimizer)
            saved["model"][step] = {k: v.clone() for k, v in model.state_dict().items()}
    saved["optim"] = copy.deepcopy(optimizer.state_dict())


@pytest.fixture
def run(tmp_path, backend, module_runs):
    """A copy of the module's run of ``backend`` (its units keep their times)."""
    run_dir = str(tmp_path / "run")
    shutil.copytree(module_runs(backend), run_dir)
    SAVED[run_dir] = SAVED[module_runs(backend)]
    return run_dir


def unit(run_dir: str, step: int, restore: bool = False) -> str:
    """The name of the main (or restore) unit of ``step``."""
    name = next(u for u in os.listdir(steps_dir(run_dir)) if u.startswith(step_stem(step) + ".")
                and ".restore" not in u)
    return restore_unit(name) if restore else name


def delete_index(run_dir: str) -> None:
    for side in ("", "-wal", "-shm"):
        if os.path.exists(index_path(run_dir) + side):
            os.remove(index_path(run_dir) + side)


def step_rows(path: str) -> list[tuple]:
    """The rows of the steps table (without commit times) of the index file ``path``."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT step, backend, location, nbytes, ntensors, tier, manifest_checksum "
                            "FROM steps ORDER BY step").fetchall()
    finally:
        conn.close()


ENCODING, PART, STORED, BASE = 6, 13, 14, 15  # columns of a tensor row


def tensor_rows(path: str) -> list[tuple]:
    """The rows of the tensors table of the index file ``path``, by step and name."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT * FROM tensors ORDER BY step, name").fetchall()
    finally:
        conn.close()


def tiers(run_dir: str) -> dict[int, str]:
    return {row[0]: row[5] for row in step_rows(index_path(run_dir))}


def assert_trajectory_reads_bit_exact(run_dir: str, steps) -> None:
    saved = SAVED[run_dir]["model"]
    with dh.open(run_dir) as h:
        for step in steps:
            for name, want in saved[step].items():
                got = h.read(f"model/{name}", step)
                assert got.dtype == want.dtype and torch.equal(got, want), (step, name)


def assert_newest_restore_point_restores_bit_exact(run_dir: str) -> None:
    model = fresh_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with dh.Checkpointer(run_dir) as ckpt:
        assert ckpt.restore(model=model, optimizer=optimizer).step == STEPS - 1
    for name, want in SAVED[run_dir]["model"][STEPS - 1].items():
        assert torch.equal(model.state_dict()[name], want), name
    want, got = SAVED[run_dir]["optim"], optimizer.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for param, state in want["state"].items():
        assert got["state"][param].keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(got["state"][param][key], value), (param, key)


# --- the run as written --------------------------------------------------------------------

def test_the_run_holds_restore_points_trajectory_points_and_deltas(run):
    assert tiers(run) == {s: "restore" if s in RESTORE_POINTS else "trajectory" for s in range(STEPS)}
    rows = tensor_rows(index_path(run))
    model = {(r[0], r[1]): r for r in rows if r[1].startswith("model/")}
    # every model tensor after step 0 is a delta against the step before, in the main unit
    assert {(s, n): (r[ENCODING], r[PART], r[BASE]) for (s, n), r in model.items()} == {
        (s, n): ("key", "", None) if s == 0 else ("delta", "", s - 1) for s in range(STEPS) for n in MODEL_TENSORS}
    rest = [r for r in rows if not r[1].startswith("model/")]
    assert {r[0] for r in rest} == set(RESTORE_POINTS)
    # the restore units of steps KeepEvery(4) keeps are compressed; those let go later are raw
    assert {r[0]: (r[ENCODING], r[PART], r[BASE]) for r in rest} == {
        s: ("key" if s % 4 == 0 else "raw", "restore", None) for s in RESTORE_POINTS}


# --- repair --------------------------------------------------------------------------------

def test_a_lost_index_is_rebuilt_as_written(run):
    written = step_rows(index_path(run)), tensor_rows(index_path(run))
    delete_index(run)
    report = repair_run(run)
    assert report.diagnosis == f"{index_path(run)} is missing"
    assert (report.steps, report.set_aside, report.lost) == (list(range(STEPS)), {}, [])
    assert (step_rows(index_path(run)), tensor_rows(index_path(run))) == written
    assert repair_run(run).diagnosis.startswith("the index is healthy")  # both units of a restore point named
    assert verify_run(run) == []
    assert_trajectory_reads_bit_exact(run, [s for s in range(STEPS) if s not in RESTORE_POINTS])
    assert_newest_restore_point_restores_bit_exact(run)


def test_a_restore_point_without_its_restore_unit_is_repaired_as_a_trajectory_point(run):
    model_bytes = sum(r[4] for r in tensor_rows(index_path(run)) if r[0] == 4 and r[1].startswith("model/"))
    remove_tree(os.path.join(steps_dir(run), unit(run, 4, restore=True)))
    report = repair_run(run)
    assert report.diagnosis == f"the index names step data that is missing: {unit(run, 4, restore=True)}"
    assert (report.steps, report.set_aside, report.lost) == (list(range(STEPS)), {}, [])
    row = next(r for r in step_rows(index_path(run)) if r[0] == 4)
    assert row[3:6] == (model_bytes, len(MODEL_TENSORS), "trajectory")
    assert [r[1] for r in tensor_rows(index_path(run)) if r[0] == 4] == sorted(MODEL_TENSORS)
    with dh.open(run) as h:
        assert h.restore_points == [0, 8, 9]
    assert verify_run(run) == []
    assert_trajectory_reads_bit_exact(run, [4])
    assert_newest_restore_point_restores_bit_exact(run)


def test_a_restore_unit_without_its_main_unit_is_set_aside(run):
    main, restore = unit(run, 9), unit(run, 9, restore=True)
    remove_tree(os.path.join(steps_dir(run), main))
    report = repair_run(run)
    assert report.steps == list(range(STEPS - 1))
    assert report.set_aside == {restore: f"a restore unit whose main unit {main} is missing"}
    assert report.in_damaged == [restore]
    assert tiers(run)[8] == "restore"
    assert verify_run(run) == []
    with dh.open(run) as h:
        assert h.restore_points == [0, 4, 8]


def test_a_restore_unit_of_another_write_is_set_aside_and_its_step_kept_as_a_trajectory_point(run):
    main, restore = unit(run, 8), unit(run, 8, restore=True)
    remove_tree(os.path.join(steps_dir(run), restore))
    source = os.path.join(steps_dir(run), unit(run, 4, restore=True))
    copy = shutil.copytree if os.path.isdir(source) else shutil.copy2
    copy(source, os.path.join(steps_dir(run), restore))  # step 4's restore unit, named as step 8's
    report = repair_run(run, force=True)
    assert report.steps == list(range(STEPS))
    assert report.set_aside == {restore: f"its manifest does not match the checksum its main unit {main} records "
                                         "(it is not the restore unit written with it, or it is damaged)"}
    assert tiers(run)[8] == "trajectory"
    assert verify_run(run) == []
    assert_trajectory_reads_bit_exact(run, [8])
    assert_newest_restore_point_restores_bit_exact(run)


def test_a_restore_unit_beside_a_step_of_one_unit_is_set_aside(run, tmp_path, backend):
    plain = str(tmp_path / "plain")
    with dh.Checkpointer(plain, backend=backend) as ckpt:
        for step in range(2):
            ckpt.write(step, fresh_model())
    source = os.path.join(steps_dir(run), unit(run, 0, restore=True))
    stray = unit(plain, 1, restore=True)
    (shutil.copytree if os.path.isdir(source) else shutil.copy2)(source, os.path.join(steps_dir(plain), stray))
    report = repair_run(plain)
    assert report.diagnosis == f"step data that the index does not name: {stray}"
    assert report.steps == [0, 1]
    assert report.set_aside == {stray: f"its main unit {unit(plain, 1)} names no restore unit (a step of one unit)"}
    assert tiers(plain) == {0: "full", 1: "full"}


@pytest.mark.parametrize("verify", [True, False])
def test_a_delta_whose_base_unit_is_gone_is_set_aside_with_every_step_that_needs_it(run, verify):
    names = {step: unit(run, step) for step in range(STEPS)}
    remove_tree(os.path.join(steps_dir(run), names[6]))
    report = repair_run(run, verify=verify)
    assert report.steps == [0, 1, 2, 3, 4, 5]
    assert report.lost == [6]

    def cannot_decode(base):
        return (f"tensor 'model/0.weight' is a delta against step {base}, which has no intact unit before it "
                "(it is missing or damaged): it cannot be decoded")
    assert report.set_aside == {
        names[7]: cannot_decode(6),
        names[8]: cannot_decode(7),
        restore_unit(names[8]): f"a restore unit whose main unit {names[8]} cannot be committed",
        names[9]: cannot_decode(8),
        restore_unit(names[9]): f"a restore unit whose main unit {names[9]} cannot be committed",
    }
    assert verify_run(run) == []
    assert_trajectory_reads_bit_exact(run, [5])


def test_a_repaired_run_goes_on_with_its_policies(run):
    """The next writer keeps the restore units repair named, writes on (a key first:
    a new Checkpointer has no delta bases) and demotes what its policies let go."""
    delete_index(run)
    repair_run(run)
    model = fresh_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with dh.Checkpointer(run, keep=dh.KeepLast(2) | dh.KeepEvery(4), trajectory=dh.Trajectory("model/*")) as ckpt:
        ckpt.restore(model=model, optimizer=optimizer)
        for step in (10, 11):
            ckpt.write(step, model, optimizer)
            SAVED[run]["model"][step] = {k: v.clone() for k, v in model.state_dict().items()}
    assert tiers(run) == {s: "restore" if s in (0, 4, 8, 10, 11) else "trajectory" for s in range(12)}
    assert sorted(u for u in os.listdir(steps_dir(run)) if ".restore" in u) == [
        restore_unit(unit(run, s)) for s in (0, 4, 8, 10, 11)]
    rows = {(r[0], r[1]): r for r in tensor_rows(index_path(run))}
    assert [rows[(s, "model/0.weight")][ENCODING] for s in (9, 10, 11)] == ["delta", "key", "delta"]
    assert verify_run(run) == []
    assert_trajectory_reads_bit_exact(run, range(12))


# --- verify --------------------------------------------------------------------------------

def _flip_a_byte_of(run_dir: str, step: int, name: str) -> None:
    """Flip one byte in the middle of the stored (encoded) bytes of tensor ``name`` of
    ``step``: found in the files of its unit as a run of the bytes its backend reads."""
    stored, part = next((r[STORED], r[PART]) for r in tensor_rows(index_path(run_dir)) if r[:2] == (step, name))
    location = unit(run_dir, step, restore=part == "restore")
    blob = np.empty(stored, np.uint8)
    reader = get_backend(step_rows(index_path(run_dir))[0][1]).open_step(steps_dir(run_dir), location)
    try:
        reader.read(name, blob, (0,))
    finally:
        reader.close()
    middle = stored // 2
    needle = blob[middle - 16:middle + 16].tobytes()
    path = os.path.join(steps_dir(run_dir), location)
    files = [os.path.join(root, f) for root, _, names in os.walk(path) for f in names] if os.path.isdir(path) \
        else [path]
    found = []
    for file in files:
        with open(file, "rb") as f:
            found += [(file, at) for at in _all_at(f.read(), needle)]
    assert len(found) == 1, found
    file, at = found[0]
    with open(file, "r+b") as f:
        f.seek(at + 16)
        byte = f.read(1)[0]
        f.seek(at + 16)
        f.write(bytes([byte ^ 0x10]))


def _all_at(data: bytes, needle: bytes) -> list[int]:
    found, at = [], data.find(needle)
    while at >= 0:
        found.append(at)
        at = data.find(needle, at + 1)
    return found


def test_verify_names_a_damaged_encoded_tensor_and_the_deltas_that_need_it(run):
    _flip_a_byte_of(run, 5, "model/0.weight")  # a delta, the base of step 6's
    _flip_a_byte_of(run, 8, "optim/state/0.weight/exp_avg")  # a key, in step 8's restore unit
    damaged = "does not match its checksum: the stored data is damaged"
    at_5 = f"tensor 'model/0.weight' of step 5 in {run} {damaged}"
    assert verify_run(run) == [
        Problem(5, "model/0.weight", at_5),
        *[Problem(s, "model/0.weight", f"its delta base at step {s - 1} cannot be read: {at_5}") for s in (6, 7)],
        Problem(8, "model/0.weight", f"its delta base at step 7 cannot be read: {at_5}"),
        Problem(8, "optim/state/0.weight/exp_avg",
                f"tensor 'optim/state/0.weight/exp_avg' of step 8 in {run} {damaged}"),
        Problem(9, "model/0.weight", f"its delta base at step 8 cannot be read: {at_5}"),
    ]
    assert verify_run(run, steps=[4, 9]) == [
        Problem(9, "model/0.weight", f"its delta base at step 8 cannot be read: {at_5}")]


def test_verify_names_a_restore_point_whose_restore_unit_is_gone(run):
    """Reported at step 4 alone: the deltas after it read their bases from its main unit."""
    remove_tree(os.path.join(steps_dir(run), unit(run, 4, restore=True)))
    problems = verify_run(run)
    assert [(p.step, p.tensor) for p in problems] == [(4, None)]
    missing = f"step 4 is committed in {run} but its data is missing: "
    assert problems[0].message.startswith(f"its data cannot be opened: {missing}")
    with dh.open(run) as h:  # the model of every other step still reads (4 is reported damaged)
        for step in (s for s in range(STEPS) if s != 4):
            for name in MODEL_TENSORS:
                h.read(name, step)


def test_verify_compares_where_the_index_says_a_tensor_lies(run):
    conn = sqlite3.connect(index_path(run))
    conn.executescript("UPDATE tensors SET part='' WHERE step=9 AND name='optim/state/0.weight/exp_avg';"
                       "UPDATE tensors SET base=3 WHERE step=5 AND name='model/0.bias';")
    conn.close()
    assert verify_run(run) == [
        Problem(5, "model/0.bias", "its index row does not match the manifest: the index is damaged"),
        Problem(9, "optim/state/0.weight/exp_avg", "its index row does not match the manifest: the index is damaged"),
    ]
