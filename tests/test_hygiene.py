"""The library leaves no files of its own outside the run, and a failure reaches the user once.

ADIOS2's BP5 engines write a profile on every close whatever the IO's
``Profile`` parameter says (ADIOS2 2.12): a reader into ``/tmp`` (never
``$TMPDIR``), named by the unit and the process id in hex; a writer into the
unit's folder. Readers here run in a child process whose working directory and
``$TMPDIR`` are empty folders, so that every place a stray file could land is
looked at, and ``/tmp`` is searched by the child's own process id (other
processes on the machine may leave theirs).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import datastates_hist as dh

READ_AND_VERIFY = r"""
import os, sys
import datastates_hist as dh
from datastates_hist.verify import verify_run
run = sys.argv[1]
print(os.getpid())
with dh.open(run) as history:
    for step in history.steps:
        for name in history.tensors(step)["name"]:
            history.read(name, step)
print(len(verify_run(run)), "problems")
"""


def write_run(run_dir: str, backend: str, steps: int = 4) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        for step in range(steps):
            ckpt.write(step, model, data={"step": step})


def profiles_of(pid: int) -> list[str]:
    return sorted(f for f in os.listdir("/tmp") if f.endswith(f"_{pid:x}_profiling.json"))


def files_under(folder: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


def test_reading_and_verifying_a_run_leaves_no_profiling_files(tmp_path):
    run_dir = str(tmp_path / "run")
    write_run(run_dir, "adios2")
    units = sorted(os.listdir(os.path.join(run_dir, "steps")))
    assert len(units) == 4
    for unit in units:  # the writers' profiles are not left in the units either
        assert sorted(os.listdir(os.path.join(run_dir, "steps", unit))) == [
            "checksums.json", "data.0", "md.0", "md.idx", "mmd.0"]
    cwd, tmpdir = tmp_path / "cwd", tmp_path / "tmpdir"
    cwd.mkdir()
    tmpdir.mkdir()
    child = subprocess.run([sys.executable, "-c", READ_AND_VERIFY, run_dir], cwd=cwd, capture_output=True,
                           text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmpdir)})
    assert child.returncode == 0, child.stderr
    pid, verdict = child.stdout.split("\n")[:2]
    assert verdict == "0 problems"
    assert profiles_of(int(pid)) == []
    assert files_under(str(cwd)) == [] and files_under(str(tmpdir)) == []
    assert not [f for f in files_under(run_dir) if f.endswith("profiling.json")]


def test_a_reader_removes_the_profile_adios2_writes_on_close(tmp_path):
    """The file is there to remove: a raw ADIOS2 reader, closed without the library, leaves it."""
    from datastates_hist.backends import _adios2_capi as capi

    run_dir = str(tmp_path / "run")
    write_run(run_dir, "adios2", steps=1)
    unit = os.path.join(run_dir, "steps", os.listdir(os.path.join(run_dir, "steps"))[0])
    profile = capi.reader_profile_path(unit)
    assert profile == f"/tmp/{os.path.basename(unit)}_{os.getpid():x}_profiling.json"
    adios = capi.Adios()
    try:
        io = adios.new_io("BP5", {})  # with Profile=Off, which BP5 ignores
        engine = adios.lib.adios2_open(io, unit.encode(), capi.MODE_READ_RANDOM_ACCESS)
        assert engine and adios.lib.adios2_close(engine) == 0
        assert os.path.exists(profile)
        capi.remove_reader_profile(unit)
        reader = capi.FileReader(adios, unit)
        reader.close()
        assert not os.path.exists(profile)
    finally:
        adios.close()
        capi.remove_reader_profile(unit)


# --- a failure reaches the user once, as the library's exception -------------------------

READ_DAMAGED = r"""
import sys
import datastates_hist as dh
try:
    with dh.open(sys.argv[1]) as history:
        history.read("model/0.weight", 1)
except dh.CorruptionError as exc:
    print(exc)
"""


def read_damaged(run_dir: str, cwd) -> subprocess.CompletedProcess:
    child = subprocess.run([sys.executable, "-c", READ_DAMAGED, run_dir], cwd=cwd, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    return child


def assert_quiet(stderr: str) -> None:
    """Nothing of a library's own on stderr: no ADIOS2 error banner, no h5py or HDF5 traceback."""
    for printed in ("ADIOS2", "Exception ignored", "HDF5-DIAG", "Traceback"):
        assert printed not in stderr, stderr


def unit_of_step_1(run_dir: str) -> str:
    steps = os.path.join(run_dir, "steps")
    return os.path.join(steps, next(u for u in sorted(os.listdir(steps)) if u.startswith("000000000001")))


@pytest.mark.parametrize("damage", ["truncated md.idx", "missing md.0"])
def test_a_damaged_bp5_unit_without_checksums_is_named_and_adios2_prints_nothing(tmp_path, damage):
    """Units written before checksums.json existed: what ADIOS2 would fail on (and print) is checked first."""
    run_dir = str(tmp_path / "run")
    write_run(run_dir, "adios2")
    unit = unit_of_step_1(run_dir)
    os.remove(os.path.join(unit, "checksums.json"))
    if damage == "truncated md.idx":
        os.truncate(os.path.join(unit, "md.idx"), 30)
        why = f"{unit}/md.idx is no BP5 index (30 bytes read): the step's BP5 metadata is damaged"
    else:
        os.remove(os.path.join(unit, "md.0"))
        why = f"{unit}/md.0 is missing from the step's BP5 files"
    child = read_damaged(run_dir, tmp_path)
    assert child.stdout == f"the data of step 1 in {run_dir} is damaged: {why}\n"
    assert_quiet(child.stderr)


def test_a_damaged_unit_is_named_and_its_library_prints_nothing(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    write_run(run_dir, backend)
    unit = unit_of_step_1(run_dir)
    damaged = os.path.join(unit, "md.idx") if backend == "adios2" else unit
    os.truncate(damaged, os.path.getsize(damaged) // 2)
    child = read_damaged(run_dir, tmp_path)
    assert child.stdout.startswith(f"the data of step 1 in {run_dir} is damaged: ") and unit in child.stdout
    assert_quiet(child.stderr)
