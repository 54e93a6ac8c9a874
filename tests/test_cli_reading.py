"""The reading commands (ls, show, diff, export) as a researcher types them: --version,
latest and negative steps, name filters, tables that fit the terminal, what each step
and tensor takes as stored, a diff that ranks what moved, and an export that never
overwrites or escapes its target."""

import json
import math
import os
import sqlite3
import subprocess
import sys

import pytest
import torch

import datastates_hist as dh
from datastates_hist.cli.output import shorten, size, when
from datastates_hist.history import compare

STEPS = (0, 1, 2, 3)
LONG = "encoder_layers_with_descriptive_names"


def cli(*args, columns=None):
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns:
        env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", "datastates_hist.cli", *args],
                          capture_output=True, text=True, env=env)


def model():
    torch.manual_seed(0)
    net = torch.nn.Sequential()
    net.add_module(LONG, torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8)))
    net.add_module("head", torch.nn.Linear(8, 3))
    torch.nn.init.zeros_(net.head.bias)
    return net


def train(path, steps, **options):
    """Step 0 before any update (a zero bias, no optimizer state yet), the others after Adam's."""
    net = model()
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    with dh.Checkpointer(path, **options) as ckpt:
        for step in steps:
            if step:
                net(torch.randn(16, 6, generator=g)).square().mean().backward()
                opt.step()
                opt.zero_grad()
            ckpt.write(step, net, opt)
            ckpt.wait()
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train(str(tmp_path_factory.mktemp("reading") / "run"), STEPS)


@pytest.fixture(scope="module")
def trajectory_run(tmp_path_factory):
    """Steps 0-5 kept as restore points by KeepLast(2) | KeepEvery(4) (0, 4, 5); the
    others kept as trajectory points (the model only)."""
    return train(str(tmp_path_factory.mktemp("reading") / "trajectory"), range(6),
                 keep=dh.KeepLast(2) | dh.KeepEvery(4), trajectory=dh.Trajectory("model/*"))


def index_rows(run, sql):
    conn = sqlite3.connect(f"file:{os.path.join(run, 'index.sqlite')}?mode=ro", uri=True)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def stored_names(run, step):
    with dh.open(run) as h:
        return h.names(step)


def test_version_is_the_package_version():
    out = cli("--version")
    assert (out.returncode, out.stdout, out.stderr) == (0, f"datastates-hist {dh.__version__}\n", "")


def test_latest_and_negative_steps_count_back_from_the_newest(run):
    newest = cli("show", run, "3", "--json").stdout
    assert json.loads(newest)
    assert cli("show", run, "latest", "--json").stdout == newest
    assert cli("show", run, "-1", "--json").stdout == newest
    assert cli("show", run, "-2", "--json").stdout == cli("show", run, "2", "--json").stdout
    assert cli("diff", run, "-3", "latest", "--json").stdout == cli("diff", run, "1", "3", "--json").stdout
    assert cli("diff", f"{run}:-2", f"{run}:-1", "--json").stdout == cli("diff", run, "2", "3", "--json").stdout
    out = cli("show", run, "-5")
    assert out.returncode == 3
    assert out.stderr == f"datastates-hist: step -5 is not committed in {run} (committed steps: 0..3 (4))\n"
    out = cli("show", run, "newest")
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == ("datastates-hist show: error: argument step: 'newest' is not a step "
                                           "(a whole number from 0 to 2**63-1, latest, or -N for the Nth newest)")


def test_show_names_filters_by_glob(run):
    out = cli("show", run, "-1", "--names", f"{LONG}.0.*", "--names", "optim/state/*/step", "--json")
    assert out.returncode == 0, out.stderr
    want = [n for n in stored_names(run, 3)
            if n.startswith(f"model/{LONG}.0.") or (n.startswith("optim/state/") and n.endswith("/step"))]
    assert [r["name"] for r in json.loads(out.stdout)] == want and len(want) == 2 + 6
    out = cli("show", run, "3", "--names", "head.*", "--names", "nothing*", "--names", "zz?")
    assert out.returncode == 3
    assert out.stderr == f"datastates-hist: no tensor of step 3 of {run} matches nothing*, zz?\n"


def test_show_fits_80_columns_without_wrapping_a_name(run):
    names = stored_names(run, 3)
    assert max(map(len, names)) > 50  # too long for 80 columns beside the figures
    out = cli("show", run, "3", columns=80)
    assert out.returncode == 0, out.stderr
    header, *lines = out.stdout.splitlines()
    assert header.split() == ["name", "shape", "dtype", "encoding", "nbytes", "stored", "norm"]
    assert len(lines) == len(names) and max(len(line) for line in out.stdout.splitlines()) <= 80
    shown = [line.split()[0] for line in lines]
    assert len(set(shown)) == len(names)  # every row's name still its own
    for name, short in zip(names, shown):  # the model's as in state_dict(), then from a part of their end
        assert short == name.removeprefix("model/") or (short.startswith(("…", "optim/…")) and len(short) < len(name)
                                                       and name.endswith(short.split("…")[1])), (name, short)
    wide = cli("show", run, "3").stdout.splitlines()  # to a pipe: full names, 6 digits
    assert [line.split()[0] for line in wide[1:]] == names
    with dh.open(run) as h:
        norm = h.tensors(3).set_index("name").loc[f"model/{LONG}.0.weight", "norm"]
    assert wide[1 + names.index(f"model/{LONG}.0.weight")].split()[-1] == f"{norm:.6g}"


def test_ls_says_each_steps_kind_and_its_bytes_as_stored(trajectory_run, run):
    out = cli("ls", trajectory_run, "--json")
    assert (out.returncode, out.stderr) == (0, "")
    got = json.loads(out.stdout)
    want = index_rows(trajectory_run, "SELECT s.step, s.time, s.tier, s.nbytes, SUM(COALESCE(t.stored, t.nbytes)),"
                      " s.ntensors FROM steps s JOIN tensors t ON t.step = s.step GROUP BY s.step ORDER BY s.step")
    assert [(r["step"], r["kind"], r["bytes"], r["stored"], r["tensors"]) for r in got] == [
        (step, "trajectory" if tier == "trajectory" else "restore", nbytes, stored, ntensors)
        for step, _, tier, nbytes, stored, ntensors in want]
    assert [r["kind"] for r in got] == ["restore", "trajectory", "trajectory", "trajectory", "restore", "restore"]
    assert any(r["stored"] < r["bytes"] for r in got)  # not the raw bytes again: compressed
    out = cli("ls", trajectory_run, columns=80)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and max(map(len, lines)) <= 80
    assert lines[0].split() == ["step", "time", "kind", "bytes", "stored", "tensors"]
    assert [line.split() for line in lines[1:]] == [
        " ".join([str(r["step"]), when(r["time"]), r["kind"], size(r["bytes"]), size(r["stored"]),
                  str(r["tensors"])]).split() for r in got]
    tiers = {tier for (tier,) in index_rows(run, "SELECT DISTINCT tier FROM steps")}
    assert tiers == {"full"} and {r["kind"] for r in json.loads(cli("ls", run, "--json").stdout)} == {"restore"}


def test_show_says_how_each_tensor_is_stored(trajectory_run):
    want = index_rows(trajectory_run, "SELECT name, encoding, base, nbytes, COALESCE(stored, nbytes), update_ratio"
                      " FROM tensors WHERE step=5 ORDER BY rowid")
    out = cli("show", trajectory_run, "5", "--json")
    assert (out.returncode, out.stderr) == (0, "")
    got = json.loads(out.stdout)
    assert [(r["name"], r["encoding"], r["base"], r["nbytes"], r["stored"], r["update_ratio"]) for r in got] == want
    encodings = {name: (encoding, base) for name, encoding, base, *_ in want}
    assert {encodings[n] for n in encodings if n.startswith("model/")} == {("delta", 4)}  # the trajectory: deltas
    # the rest, in step 5's restore unit, goes once two newer steps come (KeepEvery(4) keeps 4 and 8): raw
    assert {encodings[n] for n in encodings if not n.startswith("model/")} == {("raw", None)}
    wide = cli("show", trajectory_run, "5").stdout.splitlines()  # to a pipe: full names
    assert wide[0].split() == ["name", "shape", "dtype", "encoding", "nbytes", "stored", "norm"]
    assert [line.split()[:8] for line in wide[1:]] == [
        [name, *line.split()[1:3], "delta<-4" if encoding == "delta" else encoding, *size(nbytes).split(),
         *size(stored).split()] for line, (name, encoding, base, nbytes, stored, _) in zip(wide[1:], want)]
    narrow = cli("show", trajectory_run, "1", columns=80).stdout.splitlines()  # a trajectory point: the model
    assert max(map(len, narrow)) <= 80 and len(narrow) == 1 + len([n for n, *_ in want if n.startswith("model/")])
    assert {line.split()[3] for line in narrow[1:]} == {"delta<-0"}


def test_shorten_keeps_the_end_from_a_part_and_the_group_when_there_is_room():
    name = "optim/state/blocks.10.mlp.0.weight/exp_avg_sq"  # 45 characters
    assert shorten(name, 45) == name
    assert shorten(name, 40) == "optim/…blocks.10.mlp.0.weight/exp_avg_sq"
    assert shorten(name, 34) == "…blocks.10.mlp.0.weight/exp_avg_sq"
    assert shorten(name, 30) == "…10.mlp.0.weight/exp_avg_sq"  # from a part's start ('10.', not 'ks.10.')
    assert len(shorten(name, 40)) == 40 and len(shorten(name, 34)) == 34
    assert shorten(name, 3) == "…" + name[-15:]  # never shorter than 16


def test_compare_guards_a_zero_norm_and_flags_whole_numbers():
    grown = compare(torch.zeros(4), torch.full((4,), 0.01))
    assert math.isnan(grown["rel_l2"]) and grown["l2"] == pytest.approx(0.02)
    assert compare(torch.zeros(4), torch.zeros(4))["rel_l2"] == 0.0
    assert compare(torch.tensor(3.0), torch.tensor(5.0))["integral"] is True  # Adam's float step counter
    assert compare(torch.tensor([1, 2]), torch.tensor([1, 3]))["integral"] is True
    assert compare(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))["integral"] is False
    assert compare(torch.tensor([1.0, math.inf]), torch.tensor([1.0, math.inf]))["integral"] is False


def ranked(run, *args):
    out = cli("diff", run, *args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_diff_ranks_most_changed_first_without_counters(run):
    rows = ranked(run, "1", "3")
    names = [r["name"] for r in rows]
    counters = [n for n in stored_names(run, 3) if n.endswith(("/step", "num_batches_tracked"))]
    assert len(counters) == 6 + 1 and not set(counters) & set(names)
    assert not any(r["integral"] for r in rows)
    for metric, most_changed_first in (("l2", True), ("rel_l2", True), ("max_abs", True),
                                       ("frac_changed", True), ("cosine", False)):
        rows = ranked(run, "1", "3", "--sort", metric)
        groups = [r["name"].split("/")[0] for r in rows]
        assert groups == sorted(groups, key=["model", "optim"].index)  # the model's tensors first
        for group in ("model", "optim"):
            values = [r[metric] for r in rows if r["name"].startswith(group + "/")]
            numbers = [v for v in values if not math.isnan(v)]
            assert values[:len(numbers)] == numbers  # NaN last of its group
            assert numbers == sorted(numbers, reverse=most_changed_first), (metric, group)
        assert ranked(run, "1", "3", "--sort", metric, "--top", "3") == rows[:3]
    every = ranked(run, "1", "3", "--all")
    assert {r["name"] for r in every} == set(names) | set(counters)
    steps = ranked(run, "1", "3", "--names", "optim/state/*/step")
    assert sorted(r["name"] for r in steps) == sorted(n for n in counters if n.endswith("/step"))
    assert all(r["integral"] and r["l2"] == 2.0 for r in steps)


def test_diff_from_a_zero_bias_has_no_relative_change(run):
    rows = {r["name"]: r for r in ranked(run, "0", "3")}
    bias = rows["model/head.bias"]
    assert bias["l2"] > 0 and bias["rel_l2"] is None  # JSON has no NaN: null
    assert list(rows).index("model/head.bias") == len(rows) - 1  # ranked last by rel_l2, not first
    out = cli("diff", run, "0", "3", "--names", "head.bias", columns=80)
    assert out.stdout.splitlines()[1].split() == ["model/head.bias", "3", f"{bias['l2']:.6g}",
                                                  f"{bias['max_abs']:.6g}", "1"]  # rel_l2 and cosine blank
    out = cli("diff", run, "0", "3", "--top", "0")
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == ("datastates-hist diff: error: argument --top: '0' is not a count "
                                           "(a whole number from 1)")


def test_diff_fits_80_columns(run):
    out = cli("diff", run, "1", "3", "--all", columns=80)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and max(map(len, lines)) <= 80
    assert lines[0].split() == ["name", "shape", "l2", "rel_l2", "max_abs", "cosine", "frac_changed"]
    assert len(lines) == 1 + len(ranked(run, "1", "3", "--all"))


def test_export_refuses_a_missing_folder_an_unknown_format_and_overwriting(run, tmp_path):
    missing = str(tmp_path / "missing" / "x.safetensors")
    out = cli("export", run, "latest", "--to", missing)
    assert (out.returncode, out.stdout) == (6, "")
    assert out.stderr == f"datastates-hist: cannot write {missing}: there is no folder {tmp_path / 'missing'}\n"
    wrong = str(tmp_path / "x.bin")
    out = cli("export", run, "3", "--to", wrong)
    assert out.returncode == 2 and not os.path.exists(wrong)
    assert out.stderr == f"datastates-hist: cannot write {wrong}: export writes .safetensors, .pt, .pth, .dcp files (or say which with --format)\n"
    target = tmp_path / "x.pth"
    target.write_bytes(b"keep me")
    out = cli("export", run, "3", "--to", str(target))
    assert out.returncode == 2 and target.read_bytes() == b"keep me"
    assert out.stderr == f"datastates-hist: {target} exists: use --force to replace it\n"
    out = cli("export", run, "-1", "--to", str(target), "--force")
    assert (out.returncode, out.stdout) == (0, f"wrote 9 tensors of step 3 to {target}\n")
    with dh.open(run) as h:
        saved = torch.load(str(target), weights_only=True)
        assert saved.keys() == {n.removeprefix("model/") for n in h.names(3) if n.startswith("model/")}
        assert torch.equal(saved["head.weight"], h.read("head.weight", 3))


def test_export_names_are_keys_never_paths(tmp_path):
    run = str(tmp_path / "run")
    with dh.Checkpointer(run) as ckpt:
        ckpt.write(0, torch.nn.Linear(2, 2), **{"..escape": torch.ones(2), "a\\..\\b": torch.zeros(1)})
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = cli("export", run, "0", "--to", str(out_dir / "all.safetensors"), "--all")
    assert out.returncode == 0, out.stderr
    assert sorted(os.listdir(tmp_path)) == ["out", "run"] and os.listdir(out_dir) == ["all.safetensors"]
    from safetensors.torch import load_file

    assert {"extra/..escape", "extra/a\\..\\b"} <= set(load_file(str(out_dir / "all.safetensors")))


def test_export_of_a_trajectory_point_says_what_a_restore_point_would_hold(trajectory_run, tmp_path):
    """Step 3 keeps the model exact (Trajectory("model/*")): its model exports as a restore
    point's does, in silence; with --all, stderr says what the export lacks and where it is."""
    target = str(tmp_path / "s3.safetensors")
    out = cli("export", trajectory_run, "3", "--to", target)
    assert (out.returncode, out.stdout, out.stderr) == (0, f"wrote 9 tensors of step 3 to {target}\n", "")
    from safetensors import safe_open

    with safe_open(target, "pt") as f:
        assert "keep_bits" not in f.metadata()
    with dh.open(trajectory_run) as h:
        lacking = [n for n in h.names(4) if n not in h.names(3)]  # 4: the restore point nearest to 3
    groups = {n.split("/")[0] for n in lacking}
    assert groups == {"optim", "rng"}
    counts = ", ".join(f"{g}/*: {sum(n.startswith(g + '/') for n in lacking)}" for g in sorted(groups))
    out = cli("export", trajectory_run, "3", "--to", target, "--all", "--force")
    assert (out.returncode, out.stdout) == (0, f"wrote 9 tensors of step 3 to {target}\n")
    assert out.stderr == (f"datastates-hist: step 3 of {trajectory_run} is a trajectory point, which keeps only the "
                          f"trajectory's tensors: it lacks {len(lacking)} tensor(s) that restore point 4 (the "
                          f"nearest) holds ({counts}), and so does the export\n")
    out = cli("export", trajectory_run, "4", "--to", target, "--all", "--force")  # a restore point: all of it
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout == f"wrote {len(stored_names(trajectory_run, 4))} tensors of step 4 to {target}\n"
