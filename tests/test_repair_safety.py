"""`repair` never makes the next writer delete step data, and repairs every kind of run.

A repair builds the new index aside (``RUN/index.sqlite.rebuilding/``) and
renames it into place, so a repair killed part-way leaves the old index (or,
in the instant between the last renames, none). The writer also refuses to
delete finished units that are older than its index and that the index does
not name. Here a real ``datastates-hist repair`` process is SIGKILLed at
several points of the rebuild, and a new ``Checkpointer`` then opens the run;
multi-rank ``<step>.ranks`` runs (written under ``mpirun`` and ``torchrun``)
are repaired and restored bit for bit; symbolic links in ``steps/`` are never
followed; a step number the index cannot hold is set aside, not a crash.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import torch

import datastates_hist as dh
from datastates_hist.backends import get_backend
from datastates_hist.commit import manifest_bytes
from datastates_hist.durable import remove_tree
from datastates_hist.index import Index
from datastates_hist.layout import REBUILDING_DIR, index_path
from datastates_hist.repair import PREVIOUS_INDEX_SUFFIX, repair_run
from datastates_hist.verify import verify_run

from test_distributed import launch, needs_mpi, restored_lines, trained
from test_repair_tiers import RESTORE_POINTS, assert_newest_restore_point_restores_bit_exact
from test_repair_tiers import build_run as build_tiered_run
from test_repair_tiers import tiers

STEPS = 100


def model_at(step: int) -> torch.nn.Module:
    torch.manual_seed(step)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))


def build_run(run_dir: str, backend: str) -> None:
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        for step in range(STEPS):
            ckpt.write(step, model_at(step))


def units(run_dir: str) -> list[str]:
    return sorted(os.listdir(os.path.join(run_dir, "steps")))


def assert_restores_bit_exact(run_dir: str, steps) -> None:
    for step in steps:
        want = model_at(step).state_dict()
        with dh.open(run_dir) as h:
            for name, tensor in want.items():
                got = h.read(f"model/{name}", step)
                assert got.dtype == tensor.dtype and torch.equal(got, tensor), (step, name)


def age(run_dir: str, seconds: float) -> None:
    """Date every unit back by ``seconds``, as if written that long ago."""
    for unit in units(run_dir):
        path = os.path.join(run_dir, "steps", unit)
        st = os.stat(path)
        os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds))


# --- a repair killed part-way -------------------------------------------------------------

def _side_index(run_dir: str) -> str:
    return os.path.join(run_dir, REBUILDING_DIR, "index.sqlite")


def _rows_in_side_index(run_dir: str) -> int:
    """Steps committed so far in the index a repair is building (0 when unreadable)."""
    path = _side_index(run_dir)
    try:
        with open(path, "rb") as f:
            if f.read(20)[18:19] != b"\x01":  # still in WAL mode: leave the switch to DELETE alone
                return 0
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=0.05)
        try:
            return conn.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
        finally:
            conn.close()
    except (OSError, sqlite3.Error):
        return 0


KILL_POINTS = {
    "the new index is begun": lambda run: os.path.exists(_side_index(run)),
    "ten steps are in the new index": lambda run: _rows_in_side_index(run) >= 10,
    "the old index is moved aside": lambda run: os.path.exists(index_path(run) + PREVIOUS_INDEX_SUFFIX),
}
LAST_POINT = "the old index is moved aside"  # the repair's last act: it may end before the kill


def kill_repair_when(run_dir: str, point: str) -> None:
    """Run ``datastates-hist repair RUN --force`` and SIGKILL it once ``point`` holds."""
    proc = subprocess.Popen([sys.executable, "-m", "datastates_hist.cli", "repair", run_dir, "--force"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reached = KILL_POINTS[point]
    while proc.poll() is None and not reached(run_dir):
        time.sleep(0.0005)
    assert reached(run_dir) or point == LAST_POINT, f"repair ended before {point}:\n{proc.communicate()}"
    proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL or point == LAST_POINT, f"repair ended before {point}:\n{out}{err}"


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_a_killed_repair_leaves_no_step_for_the_next_writer_to_delete(tmp_path, backend, module_runs, point):
    run_dir = str(tmp_path / "run")
    shutil.copytree(module_runs(backend), run_dir)  # copy2: the units keep their times
    before = units(run_dir)
    kill_repair_when(run_dir, point)
    assert units(run_dir) == before
    try:
        with dh.Checkpointer(run_dir) as ckpt:  # the next writer
            assert ckpt.steps() == list(range(STEPS))
    except dh.CorruptionError as exc:  # killed between the last renames: no index, so it refuses
        assert f"holds {STEPS} step(s) of data but no index" in str(exc) and "nothing was changed" in str(exc)
    assert units(run_dir) == before  # nothing deleted
    report = repair_run(run_dir, force=True)
    assert report.steps == list(range(STEPS)) and not report.set_aside and not report.lost
    assert not os.path.exists(os.path.join(run_dir, REBUILDING_DIR))
    assert verify_run(run_dir) == []
    assert_restores_bit_exact(run_dir, [0, STEPS // 2, STEPS - 1])


@pytest.mark.parametrize("point", ["the new index is begun", LAST_POINT])
def test_a_killed_repair_of_restore_points_leaves_their_restore_units_to_the_next_writer(tmp_path, backend, point):
    """Restore units are named by their main unit's row: the next writer keeps them."""
    run_dir = str(tmp_path / "run")
    build_tiered_run(run_dir, backend)
    before = units(run_dir)
    assert len(before) == 10 + len(RESTORE_POINTS)
    kill_repair_when(run_dir, point)
    assert units(run_dir) == before
    try:
        with dh.Checkpointer(run_dir) as ckpt:
            assert ckpt.steps() == list(range(10))
    except dh.CorruptionError as exc:  # killed between the last renames: no index, so it refuses
        assert "step(s) of data but no index" in str(exc) and "nothing was changed" in str(exc)
    assert units(run_dir) == before
    report = repair_run(run_dir, force=True)
    assert report.steps == list(range(10)) and not report.set_aside and not report.lost
    assert {s for s, tier in tiers(run_dir).items() if tier == "restore"} == set(RESTORE_POINTS)
    assert verify_run(run_dir) == []
    assert_newest_restore_point_restores_bit_exact(run_dir)


def test_the_next_repair_removes_a_half_built_index_and_says_so(tmp_path, backend, module_runs):
    run_dir = str(tmp_path / "run")
    shutil.copytree(module_runs(backend), run_dir)
    kill_repair_when(run_dir, "ten steps are in the new index")
    assert os.path.exists(_side_index(run_dir))
    out = subprocess.run([sys.executable, "-m", "datastates_hist.cli", "repair", run_dir],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"{run_dir}: the index is healthy; nothing to repair (use --force to rebuild it anyway)",
        "  removed the half-built index of an earlier repair that did not finish",
    ]
    assert not [f for f in os.listdir(run_dir) if f.startswith((REBUILDING_DIR, "index.sqlite.damaged"))]


# --- the writer refuses an index younger than its units -----------------------------------

def test_the_writer_refuses_to_delete_units_older_than_its_index(tmp_path, backend):
    """An index that names only some steps and was made after all of them (what a
    repair killed part-way used to leave in place): nothing is deleted."""
    run_dir, partial = str(tmp_path / "run"), str(tmp_path / "partial")
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        for step in range(5):
            ckpt.write(step, model_at(step))
    age(run_dir, 3600)
    shutil.copytree(run_dir, partial)
    for unit in units(partial)[2:]:
        remove_tree(os.path.join(partial, "steps", unit))
    repair_run(partial, force=True)  # a new index, made now, naming steps 0 and 1
    for side in ("", "-wal", "-shm"):
        if os.path.exists(os.path.join(run_dir, "index.sqlite" + side)):
            os.remove(os.path.join(run_dir, "index.sqlite" + side))
    shutil.copyfile(os.path.join(partial, "index.sqlite"), os.path.join(run_dir, "index.sqlite"))
    before = units(run_dir)
    with pytest.raises(dh.CorruptionError, match=(
            rf"the index of {run_dir} does not name 3 finished step unit\(s\) older than the index itself "
            rf"\({', '.join(before[2:])}\): the index is younger than its step data \(lost and rebuilt, or "
            rf"replaced\), so they may be committed steps; nothing was changed\. Rebuild the index with: "
            rf"datastates-hist repair {run_dir} ")):
        dh.Checkpointer(run_dir)
    assert units(run_dir) == before
    assert repair_run(run_dir, force=True).steps == [0, 1, 2, 3, 4]
    assert_restores_bit_exact(run_dir, range(5))


def test_a_prune_cut_short_after_a_repair_is_refused_not_lost(tmp_path, backend):
    """The one case the age rule cannot tell from a younger index: a prune that deleted
    its rows and was killed before the data, on a run repaired after that data was
    written. The writer refuses (nothing changed); repair brings the step back."""
    run_dir = str(tmp_path / "run")
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        for step in range(4):
            ckpt.write(step, model_at(step))
    age(run_dir, 3600)
    repair_run(run_dir, force=True)
    index = Index(run_dir, create=True)
    index.delete_steps([1])  # prune's first half: the rows go first
    index.close()
    before = units(run_dir)
    with pytest.raises(dh.CorruptionError, match=rf"does not name 1 finished step unit\(s\) older than the "
                       rf"index itself \({before[1]}\).* \(a step whose removal by prune or truncate was cut "
                       rf"short then comes back: remove it again\)"):
        dh.Checkpointer(run_dir)
    assert units(run_dir) == before
    assert repair_run(run_dir).steps == [0, 1, 2, 3]


def test_a_crash_leftover_written_after_the_index_is_still_removed(tmp_path, backend):
    """The age rule does not keep what a crash left: a unit younger than the index,
    renamed into place before its row was committed."""
    run_dir = str(tmp_path / "run")
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        ckpt.write(0, model_at(0))
    writer = get_backend(backend).begin_step(os.path.join(run_dir, "steps"), 1)
    writer.finish(manifest_bytes(1, [], {"items": {}, "objects": {}}))
    assert len(units(run_dir)) == 2
    with dh.Checkpointer(run_dir) as ckpt:
        assert ckpt.steps() == [0]
    assert len(units(run_dir)) == 1


# --- symbolic links ------------------------------------------------------------------------

def test_an_uncommitted_symbolic_link_is_unlinked_and_its_target_kept(tmp_path, backend):
    run_dir, outside = str(tmp_path / "run"), tmp_path / "outside"
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        ckpt.write(0, model_at(0))
    (outside / "folder").mkdir(parents=True)
    (outside / "folder" / "data.0").write_bytes(b"not the run's")
    (outside / "file.h5").write_bytes(b"not the run's either")
    steps = os.path.join(run_dir, "steps")
    os.symlink(outside / "folder", os.path.join(steps, "000000000001.bp"))
    os.symlink(outside / "file.h5", os.path.join(steps, "000000000002.h5"))
    os.symlink(outside / "nothing", os.path.join(steps, "000000000003.h5.partial"))  # dangling
    with dh.Checkpointer(run_dir) as ckpt:
        assert ckpt.steps() == [0]
    assert len(units(run_dir)) == 1
    assert (outside / "folder" / "data.0").read_bytes() == b"not the run's"
    assert (outside / "file.h5").read_bytes() == b"not the run's either"


def test_repair_sets_aside_a_symbolic_link_out_of_steps(tmp_path, backend):
    run_dir, elsewhere = str(tmp_path / "run"), str(tmp_path / "elsewhere")
    for path, steps in ((run_dir, range(3)), (elsewhere, range(5))):
        with dh.Checkpointer(path, backend=backend) as ckpt:
            for step in steps:
                ckpt.write(step, model_at(step))
    unit = units(elsewhere)[4]  # a real, intact unit of step 4, outside the run
    target = os.path.join(elsewhere, "steps", unit)
    os.symlink(target, os.path.join(run_dir, "steps", unit))
    out = subprocess.run([sys.executable, "-m", "datastates_hist.cli", "repair", run_dir],
                         capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    assert "  rebuilt the index with 3 steps (0..2)" in out.stdout
    assert (f"  not committed, moved to damaged/{unit}: a symbolic link to {target}: not "
            "followed (step data must lie inside the run)") in out.stdout
    assert os.path.islink(os.path.join(run_dir, "damaged", unit)) and os.path.exists(target)
    with dh.open(run_dir) as h:
        assert h.steps == [0, 1, 2]


# --- steps the index cannot hold ----------------------------------------------------------

def test_repair_sets_aside_a_step_number_the_index_cannot_hold(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        for step in range(2):
            ckpt.write(step, model_at(step))
    writer = get_backend(backend).begin_step(os.path.join(run_dir, "steps"), 2**63)
    huge = writer.finish(manifest_bytes(2**63, [], {"items": {}, "objects": {}}))
    report = repair_run(run_dir)
    assert report.rebuilt and report.steps == [0, 1]
    assert report.set_aside == {huge: "step 9223372036854775808 does not fit the index "
                                      "(SQLite holds steps up to 2**63-1)"}
    assert os.listdir(os.path.join(run_dir, "damaged")) == [huge]
    assert report.moved_index and os.path.exists(report.moved_index)
    with dh.Checkpointer(run_dir) as ckpt:
        assert ckpt.steps() == [0, 1]
    assert_restores_bit_exact(run_dir, [0, 1])


# --- runs of several ranks ----------------------------------------------------------------

def _repair_ranks_run(run_dir: str, ranks_file: str) -> None:
    """Delete the index of a 10-step ``.ranks`` run, repair it, and restore its newest step bit for bit."""
    unit = os.path.join(run_dir, "steps", "000000000009.ranks")
    assert sorted(os.listdir(unit)) == [ranks_file.format(0), ranks_file.format(1)]
    before = units(run_dir)
    os.remove(os.path.join(run_dir, "index.sqlite"))
    report = repair_run(run_dir)
    assert report.steps == list(range(10)) and report.set_aside == {}, report
    assert units(run_dir) == before and verify_run(run_dir) == []
    restored_lines(launch("none", 1, "restore", run_dir, "9", "--model", "plain"), 1, 9)


@needs_mpi
def test_an_hdf5_run_of_two_mpi_ranks_is_repaired_and_restores_bit_exact(tmp_path):
    run_dir = str(tmp_path / "run")
    assert trained("mpirun", 2, run_dir, "--model", "ddp", "--backend", "hdf5") == list(range(10))
    _repair_ranks_run(run_dir, "rank0000{}.h5")


def test_a_torchrun_run_is_repaired_and_units_set_aside_earlier_come_back(tmp_path):
    run_dir = str(tmp_path / "run")
    assert trained("torchrun", 2, run_dir, "--model", "ddp") == list(range(10))
    _repair_ranks_run(run_dir, "rank0000{}.bp")
    # units that an earlier repair moved to damaged/ (as one that did not know .ranks
    # did) come back when moved back by hand and repaired again
    damaged = os.path.join(run_dir, "damaged")
    os.makedirs(damaged)
    for unit in units(run_dir)[3:5]:
        os.rename(os.path.join(run_dir, "steps", unit), os.path.join(damaged, unit))
    out = subprocess.run([sys.executable, "-m", "datastates_hist.cli", "repair", run_dir],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == (f"  {damaged} holds 2 unit(s) set aside by repair; to try one "
                                           "again, move it back into steps/ and run repair again")
    for unit in os.listdir(damaged):
        os.rename(os.path.join(damaged, unit), os.path.join(run_dir, "steps", unit))
    assert repair_run(run_dir).steps == list(range(10))
    restored_lines(launch("torchrun", 2, "restore", run_dir, "4", "--model", "ddp"), 2, 4)


def test_a_rebuilt_index_keeps_the_backend_the_run_was_made_with(tmp_path):
    """A run made with ADIOS2 with more of its steps in HDF5 (a session with backend="hdf5"):
    the rebuilt index still names ADIOS2, so the next writer that names none writes BP5."""
    run_dir, model = str(tmp_path / "run"), torch.nn.Linear(2, 2)
    with dh.Checkpointer(run_dir) as ckpt:
        for step in range(2):
            ckpt.write(step, model)
    with dh.Checkpointer(run_dir, backend="hdf5") as ckpt:
        for step in range(2, 5):
            ckpt.write(step, model)
    repair_run(run_dir, force=True)
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(5, model)
    assert sorted(os.listdir(os.path.join(run_dir, "steps"))) == sorted(
        [f"{s:012d}.bp" for s in (0, 1, 5)] + [f"{s:012d}.h5" for s in (2, 3, 4)])
