"""Damaged data is always detected and named; a damaged index is named at open and repaired.

Bits are flipped and files truncated at random places of real runs. The random
damage anywhere in the step files runs in a child process, so that a reader
library crashing on damaged input would fail the test instead of pytest.
"""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

import datastates_hist as dh
from datastates_hist.repair import diagnose, repair_run
from datastates_hist.store import Store
from datastates_hist.verify import verify_run

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 3


def make_run(run_dir, backend):
    """A run of STEPS steps of a two-layer model with Adam; every tensor differs per step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))
    opt = torch.optim.Adam(model.parameters())
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
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


def locate(run_dir, tensors):
    """(step, name) -> (file, offset, length) of every tensor whose bytes occur once in its unit."""
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
    make_run(run_dir, backend)
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


DAMAGE_TRIALS = r"""
import json, os, random, sys
sys.path.insert(0, sys.argv[1])
import test_corruption as t
print(json.dumps(t.damage_trials(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
"""


def damage_trials(run_dir, trials, seed):
    """Damage one random place of one random unit file per trial, check, undo.

    Returns counts of outcomes: ``detected`` (verify named the damaged step and
    only it), ``harmless`` (verify found nothing and every tensor reads back
    bit-identical), and ``silent`` (anything else: must never happen).
    """
    pristine = stored_tensors(run_dir)
    files = unit_files(run_dir)
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
            ok = {p.step for p in problems} == {step}
            outcome["detected" if ok else "silent"] += 1 if ok else [what + f": {problems}"]
        elif stored_tensors(run_dir) == pristine:
            outcome["harmless"] += 1
        else:
            outcome["silent"].append(what + ": not detected, data differs")
        with open(path, "wb") as f:
            f.write(original)
    return outcome


def test_random_damage_anywhere_in_step_files_is_detected_or_harmless(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
    child = subprocess.run([sys.executable, "-c", DAMAGE_TRIALS, HERE, run_dir, "60", "7"],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]  # a crash or abort of a reader library
    outcome = json.loads(child.stdout.strip().splitlines()[-1])
    assert outcome["silent"] == []
    assert outcome["detected"] + outcome["harmless"] == 60
    assert outcome["detected"] >= 30  # most bytes of a step unit matter
    assert verify_run(run_dir) == []  # every trial was undone


def test_truncated_data_file_names_the_step(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
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
        rows = [(r.step, r.backend, r.location, r.nbytes, r.ntensors, r.manifest_checksum)
                for r in store.index.step_rows()]
        records = {s: [(r.name, r.dtype, r.shape, r.nbytes, r.checksum, json.dumps(r.stats))
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
    make_run(run_dir, backend)
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


def test_repair_refuses_while_a_writer_runs(tmp_path):
    run_dir = str(tmp_path / "run")
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(0, torch.nn.Linear(2, 2))
        ckpt.wait()
        with pytest.raises(dh.StoreLockedError, match=f"pid {os.getpid()}"):
            repair_run(run_dir, force=True)
    assert repair_run(run_dir).rebuilt is False


def cli_main(*args):
    from datastates_hist.cli import main

    return main(list(args))


def test_cli_verify_names_step_and_tensor(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, "hdf5")
    assert cli_main("verify", run_dir) == 0
    assert "verified 3 steps" in capsys.readouterr().out
    path, at, _ = locate(run_dir, stored_tensors(run_dir))[2, "optim/state/1.bias/exp_avg_sq"]
    flip(path, at, 3)
    out = subprocess.run([sys.executable, "-m", "datastates_hist.cli", "verify", run_dir, "--json"],
                         capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert (report["steps"], report["tensors"]) == (3, sum(len(v) for v in index_view(run_dir)[1].values()))
    assert [(p["step"], p["tensor"]) for p in report["problems"]] == [(2, "optim/state/1.bias/exp_avg_sq")]
    assert cli_main("verify", run_dir, "0", "1") == 0
    assert "verified 2 steps" in capsys.readouterr().out
    assert cli_main("verify", run_dir) == 1
    out = capsys.readouterr()
    assert "2  " in out.out and "optim/state/1.bias/exp_avg_sq" in out.out and "1 problem(s)" in out.err
    assert cli_main("verify", run_dir, "9") == 3
    assert "step 9 is not committed" in capsys.readouterr().err


def test_damaged_optimizer_state_is_named_at_restore(tmp_path, backend):
    """Optimizer state is read into fresh memory or mapped from the file (HDF5): either way
    a flipped bit or a truncated file is an error naming the step, never a crash."""
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
    where = locate(run_dir, stored_tensors(run_dir))
    path, at, _ = where[1, "optim/state/0.weight/exp_avg"]
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
