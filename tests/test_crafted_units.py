"""Crafted step units are refused before anything outside the run is opened, before ADIOS2
reads a truncated file, and before memory is allocated from a crafted size.

- A BP5 unit whose files are symbolic links (or anything but regular files) is refused
  by every reader, by ``verify`` and by ``repair`` (set aside, links and targets kept);
  under ``strace`` no path outside the run is opened, stat'ed or read.
- A BP5 unit whose ``md.idx``, ``md.0`` or ``mmd.0`` is truncated, its
  ``checksums.json`` removed or recomputed (an unkeyed hash anyone can redo), is named
  as damaged instead of crashing ADIOS2 (a SIGSEGV before).
- A manifest record whose statistics or update ratio are not numbers, or whose
  records SQLite refuses, is one damaged unit for ``repair``: the other steps are
  committed.
- The xarray views allocate nothing from an index shape before a step is read.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import struct
import subprocess
import sys
import tracemalloc

import h5py
import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist.backends.bp5_files import PROFILE, unit_files, write_checksums
from datastates_hist.digest import checksum_bytes
from datastates_hist.errors import CorruptionError
from datastates_hist.items import TensorRecord

STEPS = (0, 1, 2, 3)


def write_run(run_dir: str, backend: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    with dh.Checkpointer(run_dir, backend=backend, codec="raw") as ckpt:
        for step in STEPS:
            ckpt.wait_snapshot()
            with torch.no_grad():
                model.weight.add_(1)
            ckpt.write(step, model)
    return model


def unit_path(run_dir: str, step: int, suffix: str) -> str:
    return os.path.join(run_dir, "steps", f"{step:012d}{suffix}")


def cli(*args: str, trace: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "datastates_hist.cli", *args]
    if trace:
        cmd = ["strace", "-f", "-qq", "-e", "trace=%file,%desc", "-o", trace, *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def problems(verify: subprocess.CompletedProcess) -> list[tuple]:
    return [(p["step"], p["tensor"], p["message"]) for p in json.loads(verify.stdout)["problems"]]


def strace_works() -> bool:
    if shutil.which("strace") is None:
        return False
    return subprocess.run(["strace", "-qq", "-o", os.devnull, "true"], capture_output=True).returncode == 0


def assert_quiet(stderr: str) -> None:
    for printed in ("ADIOS2", "Exception ignored", "HDF5-DIAG", "Traceback", "Segmentation"):
        assert printed not in stderr, stderr


# --- 1. symbolic links inside a BP5 unit ---------------------------------------------------

LINKED = {
    # a unit of an earlier version (no checksums.json): every file a link out of the run
    "every file, no checksums.json": ("data.0", "md.0", "md.idx", "mmd.0"),
    # checksums.json recomputed without data.0, which is a link out of the run
    "data.0, left out of checksums.json": ("data.0",),
}

READ_ALL = r"""
import sys, torch, datastates_hist as dh
run, step = sys.argv[1], int(sys.argv[2])
try:
    with dh.open(run) as h:
        h.read("weight", step)
except dh.CorruptionError as exc:
    print("read:", exc)
model = torch.nn.Linear(8, 4)
try:
    with dh.Checkpointer(run, backend="adios2") as ck:
        ck.restore(step, model, rng=False)
except dh.CorruptionError as exc:
    print("restore:", exc)
"""


def link_out(run_dir: str, outside: str, step: int, names) -> str:
    """Move ``names`` of step ``step``'s unit to ``outside`` and leave links to them."""
    unit = unit_path(run_dir, step, ".bp")
    for name in names:
        target = os.path.join(outside, name)
        shutil.move(os.path.join(unit, name), target)
        os.symlink(target, os.path.join(unit, name))
    checksums = os.path.join(unit, "checksums.json")
    if len(names) > 1:
        os.remove(checksums)
    else:
        with open(checksums) as f:
            doc = json.load(f)
        del doc["files"]["data.0"]
        doc["xxh3"] = checksum_bytes(json.dumps(doc["files"], sort_keys=True, separators=(",", ":")).encode())
        with open(checksums, "w") as f:
            json.dump(doc, f)
    return unit


@pytest.mark.parametrize("case", list(LINKED))
def test_a_bp5_unit_linking_out_of_the_run_is_refused_and_nothing_outside_is_opened(tmp_path, case):
    if not strace_works():
        pytest.skip("strace is not installed or cannot trace here")
    run_dir, outside = str(tmp_path / "run"), str(tmp_path / "outside")
    os.mkdir(outside)
    write_run(run_dir, "adios2")
    unit = link_out(run_dir, outside, 1, LINKED[case])
    kept = {name: open(os.path.join(outside, name), "rb").read() for name in os.listdir(outside)}
    why = (f"{unit}/data.0 is a symbolic link; the files of a step's BP5 unit are read only inside {unit}: "
           "refused")
    damaged = f"the data of step 1 in {run_dir} is damaged: {why}"

    trace = str(tmp_path / "read.strace")
    cmd = ["strace", "-f", "-qq", "-e", "trace=%file,%desc", "-o", trace,
           sys.executable, "-c", READ_ALL, run_dir, "1"]
    child = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines() == [f"read: {damaged}", f"restore: {damaged}"]
    assert_quiet(child.stderr)

    verify = cli("verify", "--json", run_dir, trace=str(tmp_path / "verify.strace"))
    assert verify.returncode == 1, verify.stderr
    assert problems(verify) == [(1, None, f"its data cannot be opened: {damaged}")]

    repair = cli("repair", "--force", run_dir, trace=str(tmp_path / "repair.strace"))
    assert repair.returncode == 1, repair.stderr
    assert f"  not committed, moved to damaged/000000000001.bp: {why}" in repair.stdout
    with dh.open(run_dir) as h:
        assert h.steps == [0, 2, 3]
    # set aside as it was: its links moved with it, their targets unchanged
    aside = os.path.join(run_dir, "damaged", "000000000001.bp")
    assert all(os.path.islink(os.path.join(aside, name)) for name in LINKED[case])
    assert {name: open(os.path.join(outside, name), "rb").read() for name in os.listdir(outside)} == kept

    for name in ("read", "verify", "repair"):
        with open(tmp_path / f"{name}.strace") as f:
            lines = f.readlines()
        assert any(unit in line for line in lines)  # traced: the unit itself was listed
        touched = [line for line in lines if outside in line]
        assert touched == [], f"{name} touched files outside the run: {touched[:3]}"


@pytest.mark.parametrize("entry", ["a link to a file", "a link to a folder", "a folder", "a fifo",
                                   "a link named profiling.json"])
def test_a_bp5_unit_holding_anything_but_regular_files_is_refused(tmp_path, entry):
    run_dir = str(tmp_path / "run")
    write_run(run_dir, "adios2")
    unit = unit_path(run_dir, 2, ".bp")
    extra = os.path.join(unit, PROFILE if entry == "a link named profiling.json" else "padding")
    if entry == "a link to a file" or entry == "a link named profiling.json":
        os.symlink(os.path.join(run_dir, "index.sqlite"), extra)
    elif entry == "a link to a folder":
        os.symlink(str(tmp_path), extra)
    elif entry == "a folder":
        os.mkdir(extra)
    else:
        os.mkfifo(extra)
    kind = "a symbolic link" if "link" in entry else "not a regular file"
    with dh.open(run_dir) as h:
        with pytest.raises(CorruptionError) as caught:
            h.read("weight", 2)
    assert str(caught.value) == (f"the data of step 2 in {run_dir} is damaged: {extra} is {kind}; the files "
                                 f"of a step's BP5 unit are read only inside {unit}: refused")


def test_the_profile_link_to_dev_null_of_earlier_writers_is_allowed(tmp_path):
    """Writers of earlier versions left ``profiling.json`` as a link to /dev/null: nothing reads it."""
    run_dir = str(tmp_path / "run")
    model = write_run(run_dir, "adios2")
    unit = unit_path(run_dir, 3, ".bp")
    os.symlink(os.devnull, os.path.join(unit, PROFILE))
    assert sorted(unit_files(unit)) == ["checksums.json", "data.0", "md.0", "md.idx", "mmd.0"]
    with dh.open(run_dir) as h:
        assert torch.equal(h.read("weight", 3), model.weight.detach())


# --- 2. truncated BP5 metadata --------------------------------------------------------------

READ_STEP_1 = r"""
import sys, datastates_hist as dh
try:
    with dh.open(sys.argv[1]) as h:
        d = h.step_data(1)
        for name in d.records:
            d.read(name)
    print("read everything")
except dh.CorruptionError as exc:
    print(exc)
"""


def first_mmd_record_end(mmd: str) -> int:
    with open(mmd, "rb") as f:
        id_length, info_length = struct.unpack("<2Q", f.read(16))
    return 16 + id_length + info_length


def truncation(unit: str, name: str, fraction: float) -> tuple[int, str]:
    """Cut ``name`` of ``unit`` to ``fraction`` of its size; what the reader must say of it."""
    path = os.path.join(unit, name)
    size = os.path.getsize(path)
    keep = int(size * fraction)
    if name == "mmd.0":
        end = first_mmd_record_end(path)
        os.truncate(path, keep)
        return keep, f"{path} has {keep} bytes; a record at 0 ends at {end}: it is truncated"
    if name == "md.0":
        os.truncate(path, keep)
        return keep, f"{path} has {keep} bytes; md.idx records the metadata of a step at 0 to {size}: it is truncated"
    os.truncate(path, keep)  # md.idx: inside its first record, after the 64 bytes of its header
    return keep, f"{path} ends inside a record"


@pytest.mark.parametrize("checksums", ["removed", "recomputed"])
@pytest.mark.parametrize("name, fraction", [("mmd.0", 0.3), ("mmd.0", 0.425), ("mmd.0", 0.6), ("mmd.0", 0.9),
                                            ("md.0", 0.5), ("md.idx", 0.5)])
def test_truncated_bp5_metadata_is_named_before_adios2_reads_it(tmp_path, name, fraction, checksums):
    run_dir = str(tmp_path / "run")
    write_run(run_dir, "adios2")
    unit = unit_path(run_dir, 1, ".bp")
    os.remove(os.path.join(unit, "checksums.json"))
    _keep, why = truncation(unit, name, fraction)
    if checksums == "recomputed":
        write_checksums(unit)
    child = subprocess.run([sys.executable, "-c", READ_STEP_1, run_dir], capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, child.stderr  # a SIGSEGV inside ADIOS2 before: -11
    assert child.stdout == f"the data of step 1 in {run_dir} is damaged: {why}: the step's BP5 metadata is damaged\n"
    assert_quiet(child.stderr)


def test_verify_and_repair_name_a_truncated_mmd_and_commit_the_other_steps(tmp_path):
    run_dir = str(tmp_path / "run")
    write_run(run_dir, "adios2")
    unit = unit_path(run_dir, 2, ".bp")
    _keep, why = truncation(unit, "mmd.0", 0.5)
    write_checksums(unit)
    message = f"{why}: the step's BP5 metadata is damaged"
    verify = cli("verify", "--json", run_dir)
    assert verify.returncode == 1, verify.stderr
    assert problems(verify) == [(2, None, f"its data cannot be opened: the data of step 2 in {run_dir} is "
                                          f"damaged: {message}")]
    assert_quiet(verify.stderr)
    repair = cli("repair", "--force", run_dir)
    assert repair.returncode == 1, repair.stderr
    assert f"  not committed, moved to damaged/000000000002.bp: {message}" in repair.stdout
    assert_quiet(repair.stderr)
    with dh.open(run_dir) as h:
        assert h.steps == [0, 1, 3]


def test_a_metadata_block_of_a_format_mmd_does_not_hold_is_named(tmp_path):
    """mmd.0 cut at a record's end (here: empty) leaves md.0's blocks without their format."""
    run_dir = str(tmp_path / "run")
    write_run(run_dir, "adios2")
    unit = unit_path(run_dir, 1, ".bp")
    os.truncate(os.path.join(unit, "mmd.0"), 0)
    write_checksums(unit)
    with open(os.path.join(unit, "md.0"), "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
    with dh.open(run_dir) as h:
        with pytest.raises(CorruptionError) as caught:
            h.read("weight", 1)
    assert str(caught.value) == (f"the data of step 1 in {run_dir} is damaged: {unit}/md.0 has metadata at 24 "
                                 "of a format mmd.0 does not hold: the step's BP5 metadata is damaged")
    assert size > 16  # one writer: its variables' metadata begins at 8 + 16


# --- 3. record fields SQLite cannot hold ----------------------------------------------------

def edit_h5_manifest(run_dir: str, step: int, edit) -> None:
    """Rewrite the manifest of an HDF5 step file in place (a manifest is self-describing:
    repair reads nothing else)."""
    with h5py.File(unit_path(run_dir, step, ".h5"), "r+") as f:
        doc = json.loads(f["__manifest__"][()].tobytes())
        edit(doc)
        del f["__manifest__"]
        f.create_dataset("__manifest__", data=np.frombuffer(json.dumps(doc).encode(), np.uint8))


def weight_record(doc: dict) -> dict:
    return next(r for r in doc["tensors"] if r["name"] == "model/weight")


def lose_index(run_dir: str) -> None:
    for name in os.listdir(run_dir):
        if name.startswith("index.sqlite"):
            os.remove(os.path.join(run_dir, name))


@pytest.mark.parametrize("field, value, says", [
    ("update_ratio", [1, 2], "has the update ratio [1, 2], which is not a number or null"),
    ("update_ratio", "0.5", "has the update ratio 0.5, which is not a number or null"),
    ("norm", [1.0], "has malformed statistics: {'norm': [1.0], 'min': "),
    ("nonfinite", 1.5, "has malformed statistics: {'norm': "),
    ("mean", True, "has malformed statistics: {'norm': "),
])
def test_a_record_of_malformed_numbers_is_one_damaged_unit_for_repair(tmp_path, field, value, says):
    run_dir = str(tmp_path / "run")
    write_run(run_dir, "hdf5")

    def edit(doc):
        rec = weight_record(doc)
        if field == "update_ratio":
            rec[field] = value
        else:
            rec["stats"][field] = value
    edit_h5_manifest(run_dir, 2, edit)
    lose_index(run_dir)
    repair = cli("repair", run_dir)
    assert repair.returncode == 1, repair.stderr
    line = next(l for l in repair.stdout.splitlines() if "moved to damaged/000000000002.h5" in l)
    assert line.startswith(f"  not committed, moved to damaged/000000000002.h5: the record of tensor "
                           f"'model/weight' is malformed: tensor 'model/weight' {says}") or \
        line.startswith(f"  not committed, moved to damaged/000000000002.h5: tensor 'model/weight' {says}"), line
    assert "  rebuilt the index with 3 steps" in repair.stdout
    with dh.open(run_dir) as h:
        assert h.steps == [0, 1, 3]


def test_statistics_and_update_ratio_are_checked_as_the_format_says():
    def record(**fields):
        return {"name": "w", "dtype": "float32", "shape": [2], "nbytes": 8, **fields}

    good = {"norm": 1.0, "min": -float("inf"), "max": float("nan"), "mean": 0, "std": None, "nonfinite": 2}
    assert TensorRecord.from_json(record(stats=good, update_ratio=0.25)).stats == good
    assert TensorRecord.from_json(record(update_ratio=float("nan"))).update_ratio != 0  # NaN: stored as NULL
    for stats, ratio, says in (
            ({"norm": "1"}, None, "tensor 'w' has malformed statistics: {'norm': '1'} (each is a number or null; "
                                  "nonfinite a count)"),
            ({"nonfinite": -1}, None, "tensor 'w' has malformed statistics: {'nonfinite': -1} (each is a number "
                                      "or null; nonfinite a count)"),
            ({"max": 2**64}, None, f"tensor 'w' has malformed statistics: {{'max': {2**64}}} (each is a number or "
                                   "null; nonfinite a count)"),
            ({}, {"a": 1}, "tensor 'w' has the update ratio {'a': 1}, which is not a number or null")):
        with pytest.raises(ValueError) as caught:
            TensorRecord.from_json(record(stats=stats, update_ratio=ratio))
        assert str(caught.value) == says


def test_a_unit_whose_records_the_index_refuses_is_set_aside_and_the_others_committed(tmp_path):
    """A manifest naming one tensor twice passes every record check, and the index's
    primary key refuses it: that unit is damaged, the repair goes on."""
    run_dir = str(tmp_path / "run")
    write_run(run_dir, "hdf5")
    edit_h5_manifest(run_dir, 1, lambda doc: doc["tensors"].append(dict(weight_record(doc))))
    lose_index(run_dir)
    repair = cli("repair", run_dir)
    assert repair.returncode == 1, repair.stderr
    assert ("  not committed, moved to damaged/000000000001.h5: its records cannot be committed: UNIQUE "
            "constraint failed: tensors.step, tensors.name") in repair.stdout
    with dh.open(run_dir) as h:
        assert h.steps == [0, 2, 3]
        conn = sqlite3.connect(os.path.join(run_dir, "index.sqlite"))
        assert conn.execute("SELECT COUNT(*) FROM tensors WHERE step=1").fetchone() == (0,)
        conn.close()


# --- 4. xarray views: no allocation from an index shape --------------------------------------

def craft_index_shape(run_dir: str, shape: list[int], nbytes: int) -> None:
    conn = sqlite3.connect(os.path.join(run_dir, "index.sqlite"))
    with conn:
        conn.execute("UPDATE tensors SET shape=?, nbytes=? WHERE name='model/weight'", (json.dumps(shape), nbytes))
    conn.close()


@pytest.mark.parametrize("shape", [[2**30, 2**30], [2**16, 2**16]])
def test_xarray_views_of_a_crafted_index_shape_allocate_nothing(tmp_path, backend, shape):
    xr = pytest.importorskip("xarray")
    run_dir = str(tmp_path / "run")
    write_run(run_dir, backend)
    craft_index_shape(run_dir, shape, shape[0] * shape[1] * 4)  # consistent with float32
    mismatch = (f"tensor 'model/weight' is float32 [4, 8] in the manifest but float32 {shape} in the index "
                "(or their sizes or checksums differ): the index or the step's data is damaged")
    tracemalloc.start()
    try:
        with dh.open(run_dir) as h:
            with pytest.raises(CorruptionError) as caught:
                h.to_xarray("weight").values
        assert str(caught.value) == f"step 0 in {run_dir}: {mismatch}"
        with xr.open_dataset(run_dir, engine="datastates") as ds:
            with pytest.raises(CorruptionError) as caught:
                ds["model.weight"][-1].values
        assert str(caught.value) == f"step 3 in {run_dir}: {mismatch}"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20  # a 16 GiB array was asked for before (and given, by overcommit)


@pytest.mark.parametrize("shape, nbytes, says", [
    ('[1073741824, 1073741824]', 128, "tensor 'model/weight' declares shape [1073741824, 1073741824] of float32, "
                                      "which is 4611686018427387904 bytes, but records 128 bytes"),
    ('[-4, 8]', 128, "tensor 'model/weight' has shape [-4, 8]: each dimension must be an integer from 0 to 2**63-1"),
    ('"4x8"', 128, "tensor 'model/weight' has shape '4x8': each dimension must be an integer from 0 to 2**63-1"),
    ('[4, 8', 128, "tensor 'model/weight' has the shape '[4, 8', not a JSON list"),
])
def test_xarray_views_name_an_index_row_whose_sizes_disagree(tmp_path, shape, nbytes, says):
    xr = pytest.importorskip("xarray")
    run_dir = str(tmp_path / "run")
    write_run(run_dir, "hdf5")
    conn = sqlite3.connect(os.path.join(run_dir, "index.sqlite"))
    with conn:
        conn.execute("UPDATE tensors SET shape=?, nbytes=? WHERE name='model/weight' AND step=2", (shape, nbytes))
    conn.close()
    index = os.path.join(run_dir, "index.sqlite")
    message = (f"the index {index} is damaged: step 2: {says} (rebuild it from the step data with: "
               f"datastates-hist repair {run_dir})")
    with dh.open(run_dir) as h:
        with pytest.raises(CorruptionError) as caught:
            h.to_xarray("weight")
    assert str(caught.value) == message
    with pytest.raises(CorruptionError) as caught:
        xr.open_dataset(run_dir, engine="datastates")
    assert str(caught.value) == message
