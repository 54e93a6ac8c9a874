"""Damaged data is always detected and named; a damaged index is named at open and repaired.

Bits are flipped and files truncated at random places of real runs, stored raw
(the tensors' bytes as they are, found in the files) and encoded (compressed
blobs, deltas against earlier steps). Damage to a delta's base is reported at
the damaged step, and at every later step encoded against it as a base that
cannot be read. The random damage runs in a child process, so that a reader
library crashing on damaged input would fail the test instead of pytest.
"""

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist.repair import diagnose, repair_run
from datastates_hist.store import Store
from datastates_hist.verify import verify_run

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 3


def make_run(run_dir, backend, codec="delta"):
    """A run of STEPS steps of a two-layer model with Adam; every tensor differs per step.
    With ``codec="delta"`` step 0 is stored as keys, step 1 as deltas against step 0,
    step 2 as deltas against steps 1 and 0."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))
    opt = torch.optim.Adam(model.parameters())
    with dh.Checkpointer(run_dir, backend=backend, codec=codec) as ckpt:
        for step in range(STEPS):
            model(torch.randn(4, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
            ckpt.write(step, model, opt, data={"step": step})


def unit_files(run_dir):
    """Every file of every step unit, sorted."""
    root = os.path.join(run_dir, "steps")
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def stored_tensors(run_dir):
    """(step, name) -> the stored bytes of every tensor, read without checks."""
    out = {}
    store = Store(run_dir)
    for step in store.steps():
        with store.open_step(step) as data:
            for name in data.records:
                t = data.read(name, verify=False)
                out[step, name] = t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    store.close()
    return out


def stored_blobs(run_dir):
    """(step, name) -> the blob of every encoded tensor, as its unit holds it."""
    out = {}
    store = Store(run_dir)
    for step in store.steps():
        with store.open_step(step) as data:
            for rec in data.records.values():
                if rec.encoding != "raw":
                    blob = np.empty(rec.stored, np.uint8)
                    data.readers[rec.part].read(rec.name, blob, (0,))
                    out[step, rec.name] = blob.tobytes()
    store.close()
    return out


def dependents(run_dir, step, name=None):
    """The steps after ``step`` whose tensor ``name`` (any tensor: None) is a delta
    decoded through ``step``: their base, or their base's base, ... is ``step``."""
    store = Store(run_dir)
    try:
        reached = {step}
        for later in store.steps():
            if later > step and any(r.base in reached for r in store.records(later) if name in (None, r.name)):
                reached.add(later)
        return reached - {step}
    finally:
        store.close()


def decoded_through(run_dir, step, name):
    """The values ``(step, name)`` decoded through tensor ``name`` of ``step``: deltas
    against it (and against those, ...), and predicted deltas that read it (docs/format.md,
    section 6), at its step and later."""
    store = Store(run_dir)
    try:
        reached = {(step, name)}
        for later in store.steps():
            if later >= step:
                with store.open_step(later) as data:
                    for rec in sorted(data.records.values(), key=lambda r: data.ranks.get(r.name, 0)):
                        if reached.intersection(rec.dependencies(later)):
                            reached.add((later, rec.name))
        return reached - {(step, name)}
    finally:
        store.close()


def locate(run_dir, tensors):
    """(step, name) -> (file, offset, length) of every tensor (its bytes, or its blob)
    whose bytes occur once in its unit."""
    where = {}
    for (step, name), raw in tensors.items():
        if len(raw) < 64:
            continue  # too short to be found unambiguously
        for path in unit_files(run_dir):
            if f"{step:012d}" not in path:
                continue
            content = open(path, "rb").read()
            at = content.find(raw)
            if at >= 0 and content.find(raw, at + 1) < 0:
                where[step, name] = (path, at, len(raw))
    return where


def flip(path, offset, bit):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def test_every_bit_flip_in_tensor_data_is_detected_and_named(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend, codec="raw")
    where = locate(run_dir, stored_tensors(run_dir))
    names = {name for _, name in where}
    assert {"model/0.weight", "optim/state/0.weight/exp_avg", "rng/torch"} <= names
    rng = random.Random(1)
    trials = 40
    for _ in range(trials):
        (step, name), (path, at, length) = rng.choice(sorted(where.items()))
        offset, bit = at + rng.randrange(length), rng.randrange(8)
        flip(path, offset, bit)
        problems = verify_run(run_dir)
        assert [(p.step, p.tensor) for p in problems] == [(step, name)], (path, offset)
        assert "does not match its checksum" in problems[0].message
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))
        with dh.Checkpointer(run_dir) as ckpt, pytest.raises(dh.CorruptionError) as err:
            ckpt.restore(step, model=model, optimizer=torch.optim.Adam(model.parameters()))
        assert f"tensor {name!r} of step {step}" in str(err.value) and "checksum" in str(err.value)
        flip(path, offset, bit)  # undo, so that each trial damages one tensor
    assert verify_run(run_dir) == []


def how_it_differs(run_dir, pristine):
    """None when every tensor of the run reads back as ``pristine`` (stored_tensors), else how not."""
    try:
        if stored_tensors(run_dir) == pristine:
            return None
        return "the data differs"
    except Exception as exc:
        return f"the data cannot be read ({type(exc).__name__}: {exc})"


def restore_fails(run_dir, step):
    """The message of the CorruptionError that restoring ``step`` raises, or None."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))
    try:
        with dh.Checkpointer(run_dir) as ckpt:
            ckpt.restore(step, model=model, optimizer=torch.optim.Adam(model.parameters()))
    except dh.CorruptionError as exc:
        return str(exc)
    return None


TRIALS = r"""
import json, os, random, sys
sys.path.insert(0, sys.argv[1])
import test_corruption as t
print(json.dumps(getattr(t, sys.argv[2])(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))))
"""


def trials_in_a_child(trials, run_dir, count, seed):
    """``trials(run_dir, count, seed)`` of this module, run in a child process."""
    child = subprocess.run([sys.executable, "-c", TRIALS, HERE, trials.__name__, run_dir, str(count), str(seed)],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]  # a crash or abort of a reader library
    return json.loads(child.stdout.strip().splitlines()[-1])


def blob_flip_trials(run_dir, trials, seed):
    """Flip one random bit of one encoded tensor's blob per trial, check, undo.

    Returns the names of the tensors whose blobs were found, and counts of outcomes:
    ``detected`` (verify names that tensor of that step, then each value decoded through
    it: of later steps as a delta base that cannot be read; restoring the
    step raises CorruptionError naming the tensor), ``harmless`` (verify finds nothing
    and every tensor decodes bit-identical: the flip hit a bit the decoder ignores),
    and ``wrong`` (anything else: must never happen).
    """
    pristine = stored_tensors(run_dir)
    where = locate(run_dir, stored_blobs(run_dir))
    chains = {key: decoded_through(run_dir, *key) for key in where}
    rng = random.Random(seed)
    outcome = {"names": sorted({name for _, name in where}), "detected": 0, "harmless": 0, "wrong": []}
    for _ in range(trials):
        (step, name), (path, at, length) = rng.choice(sorted(where.items()))
        offset, bit = at + rng.randrange(length), rng.randrange(8)
        flip(path, offset, bit)
        what = f"flipped bit {bit} at {offset} of {path}, in the blob of {name!r} of step {step}"
        problems = verify_run(run_dir)
        named = f"tensor {name!r} of step {step} in {run_dir}"
        if not problems:
            differs = how_it_differs(run_dir, pristine)
            if differs is None:
                outcome["harmless"] += 1
            else:
                outcome["wrong"].append(f"{what}: not detected, {differs}")
        elif ((problems[0].step, problems[0].tensor) != (step, name)
              or {(p.step, p.tensor) for p in problems} != {(step, name)} | chains[step, name]
              or not all(named in p.message for p in problems)
              or not ("does not match its checksum" in problems[0].message
                      or "cannot be decoded" in problems[0].message)
              or not all(p.message.startswith("its delta base at step ") for p in problems if p.step > step)):
            outcome["wrong"].append(f"{what}: {[str(p) for p in problems]}")
        else:
            error = restore_fails(run_dir, step)
            if error is None or named not in error:
                outcome["wrong"].append(f"{what}: restore raised {error!r}")
            else:
                outcome["detected"] += 1
        flip(path, offset, bit)
    return outcome


def test_every_bit_flip_in_an_encoded_tensors_blob_is_detected_and_named(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
    outcome = trials_in_a_child(blob_flip_trials, run_dir, 40, 5)
    assert {"model/0.weight", "optim/state/0.weight/exp_avg", "rng/torch"} <= set(outcome["names"])
    assert outcome["wrong"] == []
    assert outcome["detected"] + outcome["harmless"] == 40
    assert outcome["detected"] >= 36, outcome  # only a few bits of a blob are ignored by the decoder
    assert verify_run(run_dir) == []  # every trial was undone


def damage_trials(run_dir, trials, seed):
    """Damage one random place of one random unit file per trial, check, undo.

    Returns counts of outcomes: ``detected`` (verify named the damaged step, and
    no other but later steps encoded against it, each for a delta base that
    cannot be read), ``harmless`` (verify found nothing and every tensor reads
    back bit-identical), and ``silent`` (anything else: must never happen).
    """
    pristine = stored_tensors(run_dir)
    files = unit_files(run_dir)
    chains = {s: dependents(run_dir, s) for s in range(STEPS)}
    rng = random.Random(seed)
    outcome = {"detected": 0, "harmless": 0, "silent": []}
    for k in range(trials):
        path = rng.choice(files)
        step = int(os.path.basename(path if path.endswith(".h5") else os.path.dirname(path))[:12])
        original = open(path, "rb").read()
        if k % 3 == 2:
            cut = rng.randrange(len(original))
            open(path, "r+b").truncate(cut)
            what = f"truncated {path} to {cut}"
        else:
            offset, bit = rng.randrange(len(original)), rng.randrange(8)
            flip(path, offset, bit)
            what = f"flipped bit {bit} at {offset} of {path}"
        problems = verify_run(run_dir)
        if problems:
            ok = step in {p.step for p in problems} and all(
                p.step == step or (p.step in chains[step] and p.message.startswith("its delta base at step "))
                for p in problems)
            outcome["detected" if ok else "silent"] += 1 if ok else [what + f": {[str(p) for p in problems]}"]
        else:
            differs = how_it_differs(run_dir, pristine)
            if differs is None:
                outcome["harmless"] += 1
            else:
                outcome["silent"].append(f"{what}: not detected, {differs}")
        with open(path, "wb") as f:
            f.write(original)
    return outcome


@pytest.mark.parametrize("codec", ["raw", "delta"])
def test_random_damage_anywhere_in_step_files_is_detected_or_harmless(tmp_path, backend, codec):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend, codec)
    outcome = trials_in_a_child(damage_trials, run_dir, 60, 7)
    assert outcome["silent"] == []
    assert outcome["detected"] + outcome["harmless"] == 60
    assert outcome["detected"] >= 30  # most bytes of a step unit matter
    assert verify_run(run_dir) == []  # every trial was undone


def test_truncated_data_file_names_the_step(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend, codec="raw")
    path = max((p for p in unit_files(run_dir) if "000000000001" in p), key=os.path.getsize)
    size = os.path.getsize(path)
    open(path, "r+b").truncate(size // 2)
    problems = verify_run(run_dir)
    assert {p.step for p in problems} == {1}
    assert verify_run(run_dir, steps=[0, 2]) == []
    with dh.Checkpointer(run_dir) as ckpt:
        assert ckpt.restore(2, model=torch.nn.Sequential(torch.nn.Linear(32, 32),
                                                         torch.nn.Linear(32, 16))).step == 2
        with pytest.raises(dh.CorruptionError, match="step 1|000000000001"):
            ckpt.restore(1, model=torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16)))


def test_truncated_data_file_names_its_step_and_the_steps_encoded_against_it(tmp_path, backend):
    """Step 2 is stored as deltas against step 1: it is damaged with it, and says so."""
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
    assert dependents(run_dir, 1) == {2}
    path = max((p for p in unit_files(run_dir) if "000000000001" in p), key=os.path.getsize)
    open(path, "r+b").truncate(os.path.getsize(path) // 2)
    problems = verify_run(run_dir)
    assert {p.step for p in problems} == {1, 2}
    assert [p for p in problems if p.step == 2] and all(
        p.message.startswith("its delta base at step 1 cannot be read: ") for p in problems if p.step == 2)
    assert verify_run(run_dir, steps=[0]) == []
    assert restore_fails(run_dir, 0) is None
    for step in (1, 2):
        assert "step 1 in" in restore_fails(run_dir, step)


# --- the index ---------------------------------------------------------------------------

def commit_times(run_dir):
    store = Store(run_dir)
    try:
        return {r.step: r.time for r in store.index.step_rows()}
    finally:
        store.close()


def index_view(run_dir):
    """Everything the index says, except commit times."""
    store = Store(run_dir)
    try:
        rows = [(r.step, r.backend, r.location, r.nbytes, r.ntensors, r.tier, r.manifest_checksum)
                for r in store.index.step_rows()]
        records = {s: [(r.name, r.dtype, r.shape, r.nbytes, r.checksum, json.dumps(r.stats), r.encoding,
                        r.part, r.stored, r.base, r.update_ratio)
                       for r in store.records(s)] for s in store.steps()}
        return rows, records
    finally:
        store.close()


def assert_repaired(run_dir, expected_view):
    report = repair_run(run_dir)
    assert report.rebuilt and report.steps == list(range(STEPS)) and not report.set_aside
    assert diagnose(run_dir) is None
    assert index_view(run_dir) == expected_view
    assert verify_run(run_dir) == []
    return report


def test_random_damage_to_the_index_is_named_at_open_or_by_verify(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
    index = os.path.join(run_dir, "index.sqlite")
    assert not os.path.exists(index + "-wal")  # closed cleanly: everything is in one file
    expected = index_view(run_dir)
    original = open(index, "rb").read()
    rng = random.Random(3)
    seen = {"at open": 0, "by verify": 0, "harmless": 0}
    for k in range(40):
        for side in ("-wal", "-shm"):
            if os.path.exists(index + side):
                os.remove(index + side)
        with open(index, "wb") as f:
            f.write(original)
        if k % 4 == 3:
            open(index, "r+b").truncate(rng.randrange(len(original)))
        else:
            flip(index, rng.randrange(len(original)), rng.randrange(8))
        try:
            problems = verify_run(run_dir)
        except dh.CorruptionError as exc:
            assert "is damaged" in str(exc) and f"datastates-hist repair {run_dir}" in str(exc)
            seen["at open"] += 1
            continue
        except dh.StoreNotFoundError as exc:  # truncated to nothing: no tables left
            assert f"datastates-hist repair {run_dir}" in str(exc)
            seen["at open"] += 1
            continue
        except dh.FormatError as exc:  # a flip in the format_version value
            assert "format version" in str(exc)
            seen["at open"] += 1
            continue
        if problems:
            seen["by verify"] += 1
        else:
            assert index_view(run_dir) == expected  # undetected only where nothing differs
            seen["harmless"] += 1
    assert seen["at open"] >= 5, seen
    # the last damaged index is repaired into one that says exactly what the original said
    if diagnose(run_dir) is None:
        repair_run(run_dir, force=True)
    else:
        assert_repaired(run_dir, expected)
    assert index_view(run_dir) == expected


def test_garbage_index_gives_a_clear_error_everywhere_and_repair_rebuilds_it(tmp_path, backend, capsys):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
    expected = index_view(run_dir)
    times = commit_times(run_dir)
    index = os.path.join(run_dir, "index.sqlite")
    with open(index, "r+b") as f:
        f.write(b"this is not a database" * 10)
    message = rf"the index {index} is damaged \(file is not a database\); rebuild it from the step data with: datastates-hist repair {run_dir}"
    with pytest.raises(dh.CorruptionError, match=message):
        dh.Checkpointer(run_dir)
    with pytest.raises(dh.CorruptionError, match=message):
        Store(run_dir)
    assert cli_main("ls", run_dir) == 4
    err = capsys.readouterr().err
    assert "is damaged" in err and "datastates-hist repair" in err
    out = subprocess.run([sys.executable, "-m", "datastates_hist.cli", "repair", run_dir],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "rebuilt the index with 3 steps (0..2)" in out.stdout
    assert index_view(run_dir) == expected
    assert commit_times(run_dir) != times  # the old times were unreadable: units' modification times
    moved = [f for f in os.listdir(run_dir) if f.startswith("index.sqlite.damaged-") and "-wal" not in f
             and "-shm" not in f]
    assert moved and open(os.path.join(run_dir, moved[0]), "rb").read(22) == b"this is not a database"
    with dh.Checkpointer(run_dir) as ckpt:  # writing resumes after the repair
        ckpt.write(STEPS, torch.nn.Linear(2, 2))
    assert list(commit_times(run_dir)) == list(range(STEPS + 1))


def test_lost_index_is_refused_not_wiped_and_repair_keeps_every_step(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
    expected = index_view(run_dir)
    units = sorted(os.listdir(os.path.join(run_dir, "steps")))
    os.remove(os.path.join(run_dir, "index.sqlite"))
    with pytest.raises(dh.CorruptionError, match=r"holds 3 step\(s\) of data but no index .* nothing was changed"):
        dh.Checkpointer(run_dir)
    assert sorted(os.listdir(os.path.join(run_dir, "steps"))) == units  # nothing deleted
    report = repair_run(run_dir)
    assert report.diagnosis.endswith("index.sqlite is missing") and report.moved_index is None
    assert index_view(run_dir) == expected


def test_repair_sets_damaged_steps_aside_and_keeps_commit_times(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend, codec="raw")
    times = commit_times(run_dir)
    where = locate(run_dir, stored_tensors(run_dir))
    path, at, _ = where[1, "model/0.weight"]
    flip(path, at + 5, 0)
    report = repair_run(run_dir, force=True)
    assert report.steps == [0, 2] and list(report.set_aside) == [os.path.basename(
        path if backend == "hdf5" else os.path.dirname(path))]
    assert "'model/0.weight' of step 1" in next(iter(report.set_aside.values()))
    assert os.listdir(os.path.join(run_dir, "damaged")) == list(report.set_aside)  # kept, not deleted
    assert commit_times(run_dir) == {0: times[0], 2: times[2]}
    assert verify_run(run_dir) == []


def test_repair_sets_aside_a_damaged_step_and_the_steps_encoded_against_it(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
    times = commit_times(run_dir)
    path, at, length = locate(run_dir, stored_blobs(run_dir))[1, "model/0.weight"]
    flip(path, at + length // 2, 0)
    report = repair_run(run_dir, force=True)
    units = sorted(os.listdir(os.path.join(run_dir, "steps")) + list(report.set_aside))
    assert report.steps == [0] and sorted(report.set_aside) == units[1:]  # steps 1 and 2
    assert "'model/0.weight' of step 1" in report.set_aside[units[1]]
    assert "'model/0.weight' is a delta against step 1" in report.set_aside[units[2]]
    assert sorted(os.listdir(os.path.join(run_dir, "damaged"))) == units[1:]  # kept, not deleted
    assert commit_times(run_dir) == {0: times[0]}
    assert verify_run(run_dir) == []


def test_repair_refuses_while_a_writer_runs(tmp_path):
    run_dir = str(tmp_path / "run")
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(0, torch.nn.Linear(2, 2))
        ckpt.wait()
        with pytest.raises(dh.StoreLockedError, match="by a Checkpointer of this process that was not closed"):
            repair_run(run_dir, force=True)
    assert repair_run(run_dir).rebuilt is False


def cli_main(*args):
    from datastates_hist.cli import main

    return main(list(args))


@pytest.mark.parametrize("codec", ["raw", "delta"])
def test_cli_verify_names_step_and_tensor(tmp_path, capsys, codec):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, "hdf5", codec)
    assert cli_main("verify", run_dir) == 0
    assert "verified 3 steps" in capsys.readouterr().out
    stored = stored_tensors(run_dir) if codec == "raw" else stored_blobs(run_dir)
    # a blob long enough to be found (a predicted exp_avg_sq of 16 values takes a few bytes)
    damaged = "optim/state/1.bias/exp_avg_sq" if codec == "raw" else "optim/state/1.weight/exp_avg_sq"
    path, at, length = locate(run_dir, stored)[2, damaged]
    flip(path, at + length // 2, 3)  # inside the compressed stream (a header's first byte has spare bits)
    out = subprocess.run([sys.executable, "-m", "datastates_hist.cli", "verify", run_dir, "--json"],
                         capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert (report["steps"], report["tensors"]) == (3, sum(len(v) for v in index_view(run_dir)[1].values()))
    assert [(p["step"], p["tensor"]) for p in report["problems"]] == [(2, damaged)]
    assert cli_main("verify", run_dir, "0", "1") == 0
    assert "verified 2 steps" in capsys.readouterr().out
    assert cli_main("verify", run_dir) == 1
    out = capsys.readouterr()
    assert "2  " in out.out and damaged in out.out and "1 problem(s)" in out.err
    assert cli_main("verify", run_dir, "9") == 3
    assert "step 9 is not committed" in capsys.readouterr().err


@pytest.mark.parametrize("codec", ["raw", "delta"])
def test_damaged_optimizer_state_is_named_at_restore(tmp_path, backend, codec):
    """Optimizer state is read into fresh memory or mapped from the file (HDF5), or
    decoded from its blob: either way a flipped bit or a truncated file is an error
    naming the step, never a crash."""
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend, codec)
    where = locate(run_dir, stored_tensors(run_dir) if codec == "raw" else stored_blobs(run_dir))
    path, at, length = where[1, "optim/state/0.weight/exp_avg"]
    assert length > 100
    original = open(path, "rb").read()

    def restore_step_1():
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))
        with dh.Checkpointer(run_dir) as ckpt:
            ckpt.restore(1, model=model, optimizer=torch.optim.Adam(model.parameters()))

    flip(path, at + 100, 3)
    with pytest.raises(dh.CorruptionError, match=r"optim/state/0.weight/exp_avg.*step 1|step 1.*optim/state/0.weight/exp_avg"):
        restore_step_1()
    with open(path, "wb") as f:
        f.write(original)
    restore_step_1()
    open(path, "r+b").truncate(at + 100)
    with pytest.raises(dh.CorruptionError, match="step 1|000000000001"):
        restore_step_1()


def test_an_index_whose_schema_text_is_not_utf8_is_named_as_damage(tmp_path, backend, capsys):
    """A flipped byte in a table's CREATE statement: SQLite's own error then quotes bytes that
    are not UTF-8, which the sqlite3 module cannot decode (found by tools/fuzz_store.py)."""
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
    index = os.path.join(run_dir, "index.sqlite")
    data = open(index, "rb").read()
    at = data.index(b"CREATE TABLE steps (") + len(b"CREATE TABLE steps ")
    with open(index, "r+b") as f:
        f.seek(at)
        f.write(b"\xce")  # in place of "(": SQLite's syntax error quotes it
    message = (rf"^the index {index} is damaged \(a text in it is not UTF-8\); rebuild it from the step "
               rf"data with: datastates-hist repair {run_dir}$")
    for open_it in (lambda: dh.open(run_dir), lambda: dh.Checkpointer(run_dir), lambda: verify_run(run_dir)):
        with pytest.raises(dh.CorruptionError, match=message):
            open_it()
    assert cli_main("ls", run_dir) == 4
    assert "is damaged" in capsys.readouterr().err


def damage_dataset_header(run_dir, step, name):
    """Flip a byte in the middle of the object header of dataset ``name`` of ``step``'s unit."""
    import h5py

    (path,) = [p for p in unit_files(run_dir) if os.path.basename(p) == f"{step:012d}.h5"]
    with h5py.File(path, "r") as f:
        header = h5py.h5o.get_info(f[name].id)
        at, size = header.addr, header.hdr.space.total
    raw = bytearray(open(path, "rb").read())
    raw[at + size // 2] ^= 0x10
    open(path, "wb").write(bytes(raw))


def test_a_raw_base_whose_dataset_header_is_damaged_is_named(tmp_path):
    """A base read from a step stored raw (a reader decodes a delta against any stored
    value) names the damage of its own step."""
    run_dir = str(tmp_path / "run")
    make_run(run_dir, "hdf5", codec="raw")
    damage_dataset_header(run_dir, 0, "model/0.weight")
    store = Store(run_dir)
    try:
        with pytest.raises(dh.CorruptionError, match=rf"^tensor 'model/0.weight' of step 0 in {run_dir} cannot be "
                                                     "read: .*metadata checksum"):
            store.base(0, "model/0.weight", 1)
    finally:
        store.close()


def test_a_base_whose_dataset_header_is_damaged_is_named_at_both_steps(tmp_path):
    """HDF5 checks its object headers: a flipped byte in the header of a key's dataset
    fails the dataset's open. Read as the base of the next step's delta, it is named as
    damage of the key's step by verify, which reads every dataset through HDF5 (found by
    tools/fuzz_store.py). A restore reads the blob by the file's table of locations, whose
    bytes are intact and checked: both steps restore, bit-exact."""
    run_dir = str(tmp_path / "run")
    make_run(run_dir, "hdf5")
    name = "model/0.weight"
    store = Store(run_dir)
    assert [(r.encoding, r.base) for s in (0, 1) for r in store.records(s) if r.name == name] == [
        ("key", None), ("delta", 0)]
    expected = {}
    for step in (0, 1):
        with store.open_step(step) as data:
            expected[step] = data.read(name)
    store.close()
    damage_dataset_header(run_dir, 0, name)
    for step in (0, 1):
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))
        with dh.Checkpointer(run_dir) as ckpt:
            ckpt.restore(step, model=model, optimizer=torch.optim.Adam(model.parameters()))
        assert torch.equal(model[0].weight.detach(), expected[step])
    plain = Store(run_dir, plain_reads=True)
    try:
        with plain.open_step(0) as data, pytest.raises(dh.CorruptionError) as caught:
            data.read(name)
    finally:
        plain.close()
    assert str(caught.value).startswith(f"tensor {name!r} of step 0 in {run_dir} cannot be read: ")
    problems = {(p.step, p.tensor): p.message for p in verify_run(run_dir)}
    assert (0, name) in problems and (1, name) in problems, problems
    assert problems[1, name].startswith("its delta base at step 0 cannot be read: ")
