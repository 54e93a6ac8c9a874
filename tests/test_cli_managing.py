"""The managing commands of the command line (ls, prune, repair), run as real subprocesses
on real runs: what they print, their exit codes, and what they leave on disk."""

import json
import os
import shutil
import sqlite3
import subprocess
import sys

import torch

import datastates_hist as dh
from datastates_hist.repair import PREVIOUS_INDEX_SUFFIX

STEPS = 5


def build_run(run_dir, backend, codec="delta"):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    with dh.Checkpointer(run_dir, backend=backend, codec=codec) as ckpt:
        for step in range(STEPS):
            ckpt.wait_snapshot()
            with torch.no_grad():
                model.weight.add_(1)
            ckpt.write(step, model)


def copy_of(module_runs, backend, tmp_path):
    run_dir = str(tmp_path / "run")
    shutil.copytree(module_runs(backend), run_dir)
    return run_dir


def cli(*args):
    return subprocess.run([sys.executable, "-m", "datastates_hist.cli", *args], capture_output=True, text=True)


def unit_sizes(run_dir):
    """unit -> bytes of its files, as du would count them."""
    steps = os.path.join(run_dir, "steps")
    out = {}
    for unit in os.listdir(steps):
        path = os.path.join(steps, unit)
        files = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
        out[unit] = sum(os.path.getsize(f) for f in files)
    return out


def contents(run_dir):
    """path -> bytes of every file of the run (but SQLite's shared-memory scratch file,
    which readers may touch: it holds no data)."""
    found = {}
    for root, _dirs, files in os.walk(run_dir):
        for f in files:
            if not f.endswith("-shm"):
                path = os.path.join(root, f)
                with open(path, "rb") as fh:
                    found[os.path.relpath(path, run_dir)] = fh.read()
    return found


def commit_times(path):
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return dict(conn.execute("SELECT step, time FROM steps"))
    finally:
        conn.close()


# --- start-up ------------------------------------------------------------------------------

def torch_imported_by(code):
    out = subprocess.run([sys.executable, "-c", "import sys\n" + code + "\nprint('torch' in sys.modules)"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()[-1]


def test_help_and_ls_do_not_import_torch(module_runs, backend):
    run_dir = module_runs(backend)
    assert torch_imported_by("import datastates_hist, datastates_hist.cli") == "False"
    assert torch_imported_by("from datastates_hist.cli import main\n"
                             "try:\n    main(['--help'])\nexcept SystemExit as exc:\n    assert exc.code == 0") == "False"
    assert torch_imported_by(f"from datastates_hist.cli import main\nassert main(['ls', {run_dir!r}]) == 0") == "False"
    # the public names still come when asked for
    assert torch_imported_by("import datastates_hist as dh\nassert dh.Checkpointer.__name__ == 'Checkpointer'") == "True"


def test_ls_of_a_missing_run_says_so(tmp_path):
    out = cli("ls", str(tmp_path / "missing"))
    assert (out.returncode, out.stdout, out.stderr) == (3, "", f"datastates-hist: no run at {tmp_path / 'missing'}\n")


# --- prune ---------------------------------------------------------------------------------

def test_prune_without_a_rule_names_the_flags(module_runs):
    run_dir = module_runs("adios2")
    out = cli("prune", run_dir)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == "datastates-hist: say what to keep: --keep-last N and/or --keep-every K\n"
    out = cli("prune", run_dir, "--dry-run", "--json")
    assert out.returncode == 2 and out.stderr.endswith("say what to keep: --keep-last N and/or --keep-every K\n")


def test_prune_refuses_a_count_below_one(module_runs):
    for flag, value in (("--keep-last", "0"), ("--keep-every", "-3"), ("--keep-last", "two")):
        out = cli("prune", module_runs("adios2"), flag, value)
        assert out.returncode == 2
        assert out.stderr.splitlines()[-1] == (f"datastates-hist prune: error: argument {flag}: "
                                               f"{value!r} is not a count (a whole number from 1)")


def test_prune_dry_run_lists_the_steps_and_bytes_and_changes_nothing(backend, tmp_path):
    run_dir = str(tmp_path / "run")
    build_run(run_dir, backend, codec="key")  # no delta bases: the rules alone decide
    before = contents(run_dir)
    sizes = {int(u.split(".")[0]): n for u, n in unit_sizes(run_dir).items()}
    doomed = [1, 2, 3]  # keep the newest (4) and every 4th step (0, 4)

    out = cli("prune", run_dir, "--keep-last", "1", "--keep-every", "4", "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "removed": doomed, "kept": [0, 4], "bytes": sum(sizes[s] for s in doomed), "dry_run": True,
        "freed": [{"step": s, "bytes": sizes[s]} for s in doomed], "bases": [], "kept_restore_point": None,
    }
    out = cli("prune", run_dir, "--keep-last", "1", "--keep-every", "4", "--dry-run")
    assert out.returncode == 0, out.stderr
    total = sum(sizes[s] for s in doomed) / 1024
    assert out.stdout == f"would delete 3 steps; 2 kept; would free {total:.1f} KiB (steps 1..3)\n"
    after = contents(run_dir)
    assert after.pop("index.sqlite-wal", b"") == before.pop("index.sqlite-wal", b"")  # SQLite's readers make it
    assert after == before  # byte-identical: nothing written, nothing created

    out = cli("prune", run_dir, "--keep-last", "1", "--keep-every", "4")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"deleted 3 steps; 2 kept; freed {total:.1f} KiB (steps 1..3)\n"
    with dh.open(run_dir) as h:
        assert h.steps == [0, 4]
    out = cli("prune", run_dir, "--keep-last", "1", "--keep-every", "4", "--dry-run")
    assert out.stdout == "would delete 0 steps; 2 kept\n"


def test_prune_lists_spans_of_neighbouring_committed_steps(tmp_path):
    run_dir = str(tmp_path / "run")
    with dh.Checkpointer(run_dir, codec="key") as ckpt:
        for step in range(0, 100, 10):
            ckpt.write(step, torch.nn.Linear(2, 2))
    out = cli("prune", run_dir, "--keep-every", "40", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("would delete 6 steps; 4 kept; would free ")
    assert out.stdout.endswith(" KiB (steps 10..30, 50..70)\n")  # 0, 40, 80 kept and 90, the newest


def test_prune_of_a_delta_run_keeps_exactly_the_bases_of_kept_steps(tmp_path):
    """On a run of the default codec, a kept step keeps its delta chain back to its key:
    those steps stay, are listed as bases, and every kept step still reads bit-exact."""
    run_dir = str(tmp_path / "run")
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    written = {}
    with dh.Checkpointer(run_dir, key_every=4) as ckpt:  # chains: keys at 0, 4, 8
        for step in range(10):
            ckpt.wait_snapshot()
            with torch.no_grad():
                model.weight.add_(1)
            written[step] = model.weight.detach().clone()
            ckpt.write(step, model)
    with dh.open(run_dir) as h:
        assert [h.tensors(s)["encoding"].unique().tolist() for s in h.steps] == [
            ["key"], ["delta"], ["delta"], ["delta"], ["key"], ["delta"], ["delta"], ["delta"], ["key"], ["delta"]]
    sizes = {int(u.split(".")[0]): n for u, n in unit_sizes(run_dir).items()}
    # the rules keep 0, 6 and 9; 6 is a delta against 5, 5 against 4 (a key); 9 against 8 (a key)
    removed, kept, bases = [1, 2, 3, 7], [0, 4, 5, 6, 8, 9], [4, 5, 8]
    freed = sum(sizes[s] for s in removed)

    out = cli("prune", run_dir, "--keep-last", "1", "--keep-every", "6", "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "removed": removed, "kept": kept, "bytes": freed, "dry_run": True,
        "freed": [{"step": s, "bytes": sizes[s]} for s in removed], "bases": bases, "kept_restore_point": None,
    }
    out = cli("prune", run_dir, "--keep-last", "1", "--keep-every", "6")
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout == (f"deleted 4 steps; 6 kept; freed {freed / 1024:.1f} KiB (steps 1..3, 7)\n"
                          "3 kept only as delta bases of kept steps (steps 4, 5, 8)\n")
    assert sorted(int(u.split(".")[0]) for u in unit_sizes(run_dir)) == kept
    with dh.open(run_dir) as h:
        assert h.steps == kept
        for step in kept:
            assert torch.equal(h.read("model/weight", step), written[step])
    out = cli("verify", run_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    out = cli("prune", run_dir, "--keep-last", "1", "--keep-every", "6")  # the bases stay while needed
    assert out.stdout == "deleted 0 steps; 6 kept\n3 kept only as delta bases of kept steps (steps 4, 5, 8)\n"


# --- repair --force on a healthy run ---------------------------------------------------------

def test_repair_force_on_a_healthy_run_keeps_one_previous_index_and_no_clutter(module_runs, backend, tmp_path):
    run_dir = copy_of(module_runs, backend, tmp_path)
    index = os.path.join(run_dir, "index.sqlite")
    previous = index + PREVIOUS_INDEX_SUFFIX
    times = commit_times(index)
    for _ in range(3):
        out = cli("repair", run_dir, "--force")
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == [
            f"{run_dir}: rebuilt on request (--force)",
            f"  the old index was kept as {previous} (the next repair --force replaces it)",
            f"  rebuilt the index with {STEPS} steps (0..{STEPS - 1})",
        ]
        assert sorted(os.listdir(run_dir)) == ["index.sqlite", "index.sqlite.previous", "steps", "writer.lock"]
        assert commit_times(index) == times == commit_times(previous)  # the old index's times, not file times
    conn = sqlite3.connect(f"file:{previous}?mode=ro", uri=True)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)  # one file: no -wal to go with it
    finally:
        conn.close()
    with dh.Checkpointer(run_dir) as ckpt:  # writing resumes
        ckpt.write(STEPS, torch.nn.Linear(2, 2))
    with dh.open(run_dir) as h:
        assert h.steps == list(range(STEPS + 1))


def test_repair_force_while_a_reader_has_the_index_open_moves_its_wal_along(module_runs, tmp_path):
    from datastates_hist.index import Index
    from datastates_hist.repair import repair_run

    run_dir = copy_of(module_runs, "adios2", tmp_path)
    reader = Index(run_dir)
    try:
        assert reader.steps() == list(range(STEPS))
        report = repair_run(run_dir, force=True)
        assert report.moved_index == os.path.join(run_dir, "index.sqlite" + PREVIOUS_INDEX_SUFFIX)
        assert reader.steps() == list(range(STEPS))  # still reads the index it opened
    finally:
        reader.close()
    assert commit_times(report.moved_index) == commit_times(os.path.join(run_dir, "index.sqlite"))
    repair_run(run_dir, force=True)  # replaces the kept index and the WAL files that went with it
    assert sorted(os.listdir(run_dir)) == ["index.sqlite", "index.sqlite.previous", "steps", "writer.lock"]


def test_a_damaged_index_is_still_kept_for_inspection_beside_the_previous_one(module_runs, tmp_path):
    run_dir = copy_of(module_runs, "adios2", tmp_path)
    assert cli("repair", run_dir, "--force").returncode == 0
    previous = os.path.join(run_dir, "index.sqlite" + PREVIOUS_INDEX_SUFFIX)
    with open(previous, "rb") as f:
        kept = f.read()
    with open(os.path.join(run_dir, "index.sqlite"), "wb") as f:
        f.write(b"this is not a database" * 100)
    out = cli("repair", run_dir)
    assert out.returncode == 0, out.stderr
    damaged = [f for f in os.listdir(run_dir) if f.startswith("index.sqlite.damaged-")]
    assert len(damaged) == 1 and f"  the old index was moved to {os.path.join(run_dir, damaged[0])}" in out.stdout
    with open(os.path.join(run_dir, damaged[0]), "rb") as f:
        assert f.read(22) == b"this is not a database"
    with open(previous, "rb") as f:
        assert f.read() == kept  # a damaged index does not replace the healthy one kept
