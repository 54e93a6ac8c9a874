"""The command line at its edges: an export never writes inside the run it reads and
reports a failed write as one line; trace's table keeps every series and every number
in 80 columns; JSON output is JSON (no NaN); a damaged index row is named as damage;
a plot goes where it says; a scalar whose name holds a '[' is found by its name."""

import json
import math
import os
import sqlite3
import subprocess
import sys
import time

import pytest
import torch

import datastates_hist as dh
from datastates_hist.cli import EXIT_DAMAGED, EXIT_IO, EXIT_MISSING, EXIT_USAGE
from test_bad_inputs import read_only


def cli(*args, columns=None):
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns:
        env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", "datastates_hist.cli", *map(str, args)],
                          capture_output=True, text=True, env=env)


def last_line(out) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    return out.stderr.strip().splitlines()[-1]


def write_run(path, steps=(0, 1, 2), size=(4, 3), data=None):
    torch.manual_seed(0)
    net = torch.nn.Linear(*size)
    with dh.Checkpointer(path) as ckpt:
        for step in steps:
            with torch.no_grad():
                net.weight.add_(0.01 * step)
            ckpt.write(step, net, data=data(step) if data else {"loss": 1.0 / (step + 1)})
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("edges") / "run")


def test_export_never_writes_inside_the_run(run):
    before = sorted(os.listdir(run / "steps"))
    target = run / "steps" / before[0]
    out = cli("export", run, "0", "--to", target, "--force", "--format", "torch")
    assert out.returncode == EXIT_USAGE
    assert last_line(out) == f"datastates-hist: cannot write {target}: it is inside the run {run}; export to a " \
                             "path outside it"
    out = cli("export", run, "0", "--to", run / "model.safetensors")
    assert out.returncode == EXIT_USAGE and "it is inside the run" in last_line(out)
    assert sorted(os.listdir(run / "steps")) == before and not (run / "model.safetensors").exists()
    with dh.open(run) as h:
        assert h.steps == [0, 1, 2]


def test_export_to_a_path_ending_in_a_slash(run, tmp_path):
    out = cli("export", run, "2", "--to", f"{tmp_path}/a.pt/")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"wrote 2 tensors of step 2 to {tmp_path}/a.pt\n"
    assert sorted(os.listdir(tmp_path)) == ["a.pt"]
    with dh.open(run) as h:
        assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=True)["weight"], h.read("weight", 2))


@pytest.mark.skipif(os.geteuid() != 0, reason="a full and a read-only file system are mounted as root")
@pytest.mark.parametrize("suffix", [".pt", ".safetensors", ".dcp"])
def test_a_failed_export_write_is_one_line(tmp_path, suffix):
    big = write_run(tmp_path / "big", steps=(0,), size=(1200, 1000))  # 4.8 MB of weights, on a 4 MB disk
    with read_only(str(tmp_path / "small")) as _:
        target = tmp_path / "small" / f"out{suffix}"
        out = cli("export", big, "0", "--to", target)
        assert out.returncode == EXIT_IO
        assert last_line(out).startswith(f"datastates-hist: cannot write {target}") and \
            "No space left on device" in last_line(out), out.stderr
        assert os.listdir(tmp_path / "small") == []
    with read_only(str(tmp_path / "frozen")) as freeze:
        freeze()
        target = tmp_path / "frozen" / f"out{suffix}"
        out = cli("export", big, "0", "--to", target)
        assert out.returncode == EXIT_IO
        assert last_line(out).startswith(f"datastates-hist: cannot write {target}") and \
            "Read-only file system" in last_line(out), out.stderr


def test_trace_keeps_every_series_in_80_columns(tmp_path):
    names = [f"a_rather_long_name_of_a_validation_metric_{i}" for i in range(6)]  # shown as written
    run = write_run(tmp_path / "run", steps=range(4),
                    data=lambda step: {n: 1234.56789 + step * 1000.123 + i for i, n in enumerate(names)})
    out = cli("trace", run, "a_rather_long_name_of_a_validation_metric_*", columns=80)
    assert out.returncode == 0, out.stderr
    tables = out.stdout.split("\n\n")  # the series in several tables, each with the steps
    assert max(map(len, out.stdout.splitlines())) <= 80
    assert len(tables) == 6  # one series each at 80 columns, the sparklines after the last
    for i, (name, part) in enumerate(zip(names, tables)):
        assert part.splitlines()[:5] == [f"step  {name}"] + [
            f"{step:<4}  {f'{1234.56789 + step * 1000.123 + i:.6g}':>{len(name)}}"
            for step in range(4)]
    assert tables[-1].splitlines()[5:] == [f"{name}: ▁▃▆█" for name in names]


def test_trace_of_a_name_longer_than_the_terminal_keeps_the_steps_and_never_wraps(tmp_path):
    """The label is shortened (its end kept), beside the step column and beside its
    sparkline; --json keeps the stored name."""
    name = "base_model.model.layers.23.self_attn.q_proj.lora_A.default.weight_" + "x" * 20  # 87 characters
    run = tmp_path / "run"
    with dh.Checkpointer(run) as ckpt:
        for step in range(3):
            ckpt.write(step, torch.nn.Linear(1, 1), data={"loss": float(step)}, **{name: torch.ones(2) * 2 ** step})
    out = cli("trace", run, "extra/base_model*", "loss", columns=80)
    assert out.returncode == 0, out.stderr
    label = "extra/…elf_attn.q_proj.lora_A.default.weight_xxxxxxxxxxxxxxxxxxxx norm"
    assert out.stdout.splitlines() == [
        f"step  {label}", *(f"{step:<4}  {f'{math.sqrt(2) * 2 ** step:.6g}':>{len(label)}}" for step in range(3)),
        "", "step  loss", "0        0", "1        1", "2        2", f"{label}: ▁▃█", "loss: ▁▅█"]
    assert max(map(len, out.stdout.splitlines())) <= 80
    data = json.loads(cli("trace", run, "extra/base_model*", "--json").stdout)
    assert data["name"] == f"extra/{name}"


def test_trace_in_a_terminal_of_30_columns_keeps_its_step_column(tmp_path):
    run = tmp_path / "run"
    with dh.Checkpointer(run) as ckpt:
        for step in range(3):
            model = torch.nn.Module()
            model.register_buffer("alpha_beta_gamma_delta_weight_matrix", torch.ones(3) * (step + 1))
            ckpt.write(step, model)
    out = cli("trace", run, "alpha*", "--stat", "update_ratio", columns=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "step  …_matrix update_ratio"
    assert [line.split() for line in lines[1:4]] == [["0"], ["1", "1"], ["2", "0.5"]]  # blank at the key step
    assert lines[4:] == ["…_matrix update_ratio:  █▁"]
    assert max(map(len, lines)) <= 30


def test_names_alike_to_their_ends_keep_their_starts_apart():
    from datastates_hist.cli.output import shorten_names

    names = ["extra/a" + "x" * 150, "extra/b" + "x" * 150]
    assert shorten_names(names, 30) == ["extra/axxx…" + "x" * 19, "extra/bxxx…" + "x" * 19]


def test_diff_json_has_no_nan(tmp_path):
    run = tmp_path / "run"
    net = torch.nn.Linear(3, 1, bias=False)
    with dh.Checkpointer(run) as ckpt:
        torch.nn.init.zeros_(net.weight)
        ckpt.write(0, net)
        ckpt.wait()
        torch.nn.init.constant_(net.weight, 0.5)  # not whole numbers: diff compares it by default
        ckpt.write(1, net)
    out = cli("diff", run, "0", "1", "--json")
    assert out.returncode == 0, out.stderr

    def refuse(token):
        raise AssertionError(f"{token} in JSON output")

    rows = json.loads(out.stdout, parse_constant=refuse)
    assert [(r["name"], r["rel_l2"], r["l2"]) for r in rows] == [("model/weight", None, math.sqrt(0.75))]


def test_diff_of_runs_with_no_tensor_in_common(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    with dh.Checkpointer(a) as ckpt:
        ckpt.write(0, torch.nn.Linear(2, 2))
    with dh.Checkpointer(b) as ckpt:
        ckpt.write(0, torch.nn.Sequential(torch.nn.Linear(2, 2)))
    out = cli("diff", f"{a}:0", f"{b}:0")
    assert out.returncode == EXIT_MISSING
    assert last_line(out) == f"datastates-hist: step 0 of {a} and step 0 of {b} have no tensor in common"


def test_a_scalar_named_with_a_bracket_is_traced_by_its_name(tmp_path):
    run = write_run(tmp_path / "run", data=lambda step: {"acc[top1]": 0.5 + step, "acc_top1": -1.0})
    out = cli("trace", run, "acc[top1]", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["series"] == {"extra/data/acc[top1]": [0.5, 1.5, 2.5]}
    with dh.open(run) as h:
        assert list(h.scalars("acc[top1]").columns) == ["extra/data/acc[top1]"]


def test_trace_plot_goes_where_it_says(run, tmp_path):
    out = cli("trace", run, "loss", "--plot", tmp_path)
    assert out.returncode == EXIT_USAGE
    assert last_line(out) == f"datastates-hist: cannot write the plot to {tmp_path}: it is a folder; name a file " \
                             "(.png, .pdf, .svg)"
    out = cli("trace", run, "loss", "--plot", tmp_path / "curve", "--json")
    assert out.returncode == 0, out.stderr
    assert out.stderr == f"wrote {tmp_path / 'curve.png'}\n"
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out.stdout)["values"] == [1.0, 0.5, 1 / 3]


@pytest.mark.parametrize("sql, command, what", [
    ("UPDATE steps SET time=1e20 WHERE step=1", "ls", "the row of step 1 holds (1, 1e+20,"),
    ("UPDATE steps SET ntensors='many' WHERE step=2", "ls", "the row of step 2 holds (2,"),
    ("UPDATE scalars SET value='abc' WHERE step=1", "trace", "scalar 'extra/data/loss' of step 1 is 'abc', not a number"),
])
def test_a_damaged_index_row_is_named_as_damage(tmp_path, sql, command, what):
    run = write_run(tmp_path / "run")
    with sqlite3.connect(run / "index.sqlite") as conn:
        conn.execute(sql)
    conn.close()
    out = cli(command, run, *(["loss"] if command == "trace" else []))
    assert out.returncode == EXIT_DAMAGED
    line = last_line(out)
    assert line.startswith(f"datastates-hist: the index {run / 'index.sqlite'} is damaged (") and what in line
    assert line.endswith(f"rebuild it from the step data with: datastates-hist repair {run}")
    out = cli("repair", run)
    assert out.returncode == 0, out.stderr
    out = cli(command, run, *(["loss"] if command == "trace" else []), "--json")
    assert out.returncode == 0, out.stderr
    with dh.open(run) as h:
        assert h.steps == [0, 1, 2]
        assert h.scalars("loss")["extra/data/loss"].tolist() == [1.0, 0.5, 1 / 3]
        unit = {row.step: row for row in h.store.index.step_rows()}
        assert all(0 < unit[s].time < time.time() + 1 for s in (0, 1, 2))


def test_repair_takes_no_commit_time_an_index_cannot_hold(tmp_path):
    run = write_run(tmp_path / "run")
    (run / "index.sqlite").unlink()
    for unit in os.listdir(run / "steps"):  # a clock before 1970 set them
        os.utime(run / "steps" / unit, (-1e8, -1e8))
    assert cli("repair", run).returncode == 0
    out = cli("ls", run, "--json")
    assert out.returncode == 0, out.stderr
    assert [row["step"] for row in json.loads(out.stdout)] == [0, 1, 2]


def test_trace_names_each_series_shortly_unless_two_would_read_the_same():
    from datastates_hist.cli.trace import labels

    assert labels(["extra/data/loss", "extra/data/lr", "extra/lr", "extra/data/acc[top1]", "model/0.weight"],
                  {"model/0.weight"}) == {
        "extra/data/loss": "loss", "extra/data/lr": "extra/data/lr", "extra/lr": "extra/lr",
        "extra/data/acc[top1]": "acc[top1]", "model/0.weight": "0.weight"}


def test_a_narrow_diff_keeps_every_name_its_own_and_says_which_columns_gave_way(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
                                  for _ in range(12)])
    opt = torch.optim.Adam(model.parameters())
    with dh.Checkpointer(tmp_path / "run") as ckpt:
        for step in range(2):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            ckpt.write(step, model, opt)
    for names in (["--names", "optim/*exp_avg*"], []):
        out = cli("diff", tmp_path / "run", "0", "1", *names, columns=60)
        assert out.returncode == 0, out.stderr
        header, *lines = out.stdout.splitlines()
        shown = [line.split()[0] for line in lines]
        assert len(lines) == 24 * 2 * (2 if names else 3)  # 24 layers' weight, bias: (model,) exp_avg, exp_avg_sq
        assert len(set(shown)) == len(shown) and max(map(len, out.stdout.splitlines())) <= 60
        assert not any(s.startswith("model/") for s in shown)  # the model's names as in state_dict()
        # the metrics not ranked by give way, in order, and stderr names them
        left_out = [m for m in ("frac_changed", "max_abs", "l2", "cosine") if m not in header.split()]
        assert header.split() == ["name", "shape"] + [m for m in ("l2", "rel_l2", "max_abs", "cosine", "frac_changed")
                                                      if m not in left_out]
        assert left_out[:1] == ["frac_changed"]
        assert out.stderr == f"({', '.join(left_out)} left out to fit 60 columns; --json has every column)\n"


def test_a_sparkline_of_more_steps_than_room_is_one_bar_per_run_of_steps():
    from datastates_hist.cli.trace import BARS, sparkline

    line = sparkline([float(v) for v in range(100)], width=10)  # runs of 10: their means 4.5 ... 94.5
    assert line == "".join(BARS[i] for i in (0, 0, 1, 2, 3, 4, 5, 6, 7, 7))
    assert sparkline([None, None, 1.0, 3.0, 5.0, 7.0], width=3) == " ▁█"  # a run of no value is blank
    assert sparkline([1.0, 2.0], width=10) == "▁█"  # fewer values than room: one bar each


def test_diff_says_what_one_step_alone_holds(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(net.parameters())
    with dh.Checkpointer(tmp_path / "run", keep=dh.KeepLast(1), trajectory=dh.Trajectory("model/*")) as ckpt:
        for step in range(2):
            net(torch.randn(2, 3)).sum().backward()
            opt.step()
            ckpt.write(step, net, opt)
    out = cli("diff", tmp_path / "run", "0", "1")  # step 0 a trajectory point: the model's tensors alone
    assert out.returncode == 0, out.stderr
    assert sorted(line.split()[0] for line in out.stdout.splitlines()[1:]) == ["model/bias", "model/weight"]
    with dh.open(tmp_path / "run") as h:  # its optimizer's state (the RNG states a diff never compares)
        alone = len([r for r in h.store.records(1) if r.name.startswith("optim/")])
    assert alone == 6 and out.stderr == f"({alone} tensors only in step 1: not compared)\n"
    assert cli("diff", tmp_path / "run", "0", "1", "--names", "weight").stderr == ""
    assert cli("diff", tmp_path / "run", "0", "1", "--names", "optim/*").returncode == EXIT_MISSING


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_an_exported_file_is_as_readable_as_any_file_made_here(run, tmp_path, suffix):
    mask = os.umask(0o022)
    try:
        out = cli("export", run, "0", "--to", tmp_path / f"out{suffix}")
    finally:
        os.umask(mask)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / f"out{suffix}").stat().st_mode & 0o777 == 0o644


def test_a_run_that_is_a_file_is_named_so(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    out = cli("ls", tmp_path / "notes.txt")
    assert (out.returncode, out.stdout) == (EXIT_MISSING, "")
    assert out.stderr == f"datastates-hist: no run at {tmp_path / 'notes.txt'}: it is a file, and a run is a folder\n"


def test_a_step_from_pattern_is_quoted_as_typed(tmp_path):
    torch.save({"w": torch.ones(1)}, tmp_path / "a.pt")
    out = cli("import", tmp_path / "run", tmp_path / "a.pt", "--step-from", r"stp(\d+)")
    assert out.returncode == EXIT_USAGE
    assert last_line(out) == (f"datastates-hist: cannot tell the step of {tmp_path / 'a.pt'}: --step-from "
                              r"'stp(\d+)' finds no step in its name 'a'")


def test_names_apart_in_a_narrow_table_even_where_a_part_would_lose_them():
    from datastates_hist.cli.output import shorten_names
    from datastates_hist.cli.trace import labels

    names = ["model/layers.10.self_attn.q_proj.weight", "model/layers.11.self_attn.q_proj.weight"]
    assert shorten_names(names, 26) == ["…0.self_attn.q_proj.weight", "…1.self_attn.q_proj.weight"]
    # a short name that another series' stored name also reads: every label still its own
    assert labels(["extra/data/loss", "extra/loss", "extra/extra/loss"], set()) == {
        "extra/data/loss": "extra/data/loss", "extra/loss": "extra/loss", "extra/extra/loss": "extra/extra/loss"}


def test_a_name_holding_brackets_is_printed_as_written(tmp_path):
    run = write_run(tmp_path / "run", data=lambda step: {"acc[top1]": step / 2, "loss": 1.0})
    out = cli("trace", run, "acc[top1]", "loss", columns=80)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].split() == ["step", "acc[top1]", "loss"]
    assert out.stdout.splitlines()[-2] == "acc[top1]: ▁▅█"


def test_a_tensor_name_holding_brackets_selects_that_tensor_not_what_its_glob_matches(tmp_path):
    """`a[0]` is the glob of `a0`; where a tensor is named `a[0]`, it is that tensor (as trace
    takes it); a glob that names no tensor still matches as a glob."""
    run = tmp_path / "run"
    model = torch.nn.Module()
    with dh.Checkpointer(run) as ckpt:
        for step in range(2):
            model.register_buffer("a[0]", torch.ones(2) * (step + 1))
            model.register_buffer("a0", torch.zeros(3))
            ckpt.write(step, model)
        del model._buffers["a[0]"]
        ckpt.write(2, model)  # step 2 holds a0 alone: 'a[0]' still names the tensor, not a0
    show = cli("show", run, "1", "--names", "a[0]", "--json")
    assert [r["name"] for r in json.loads(show.stdout)] == ["model/a[0]"]
    diff = cli("diff", run, "0", "1", "--names", "a[0]", "--json")
    assert [(r["name"], r["l2"]) for r in json.loads(diff.stdout)] == [("model/a[0]", math.sqrt(2))]
    alone = cli("diff", run, "1", "2", "--names", "a[0]")
    assert (alone.returncode, alone.stdout) == (EXIT_MISSING, "")
    assert last_line(alone) == "datastates-hist: no tensor matches a[0] in both steps"
    glob = cli("show", run, "1", "--names", "a[0-9]", "--json")
    assert [r["name"] for r in json.loads(glob.stdout)] == ["model/a0"]
    import xarray as xr

    with xr.open_dataset(run, engine="datastates", names="a[0]", steps=[0, 1]) as ds:
        assert list(ds.data_vars) == ["model.a[0]"]
        assert ds["model.a[0]"].values.tolist() == [[1.0, 1.0], [2.0, 2.0]]


def test_diff_of_a_step_with_itself_says_so(run):
    out = cli("diff", run, "1", "1")
    assert out.returncode == 0 and out.stderr == "(step 1 compared with itself: nothing changed)\n"
    assert {line.split()[3] for line in out.stdout.splitlines()[1:]} == {"0"}  # rel_l2


def test_repair_of_a_file_names_it_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    out = cli("repair", tmp_path / "notes.txt")
    assert (out.returncode, out.stdout) == (EXIT_MISSING, "")
    assert out.stderr == f"datastates-hist: no run at {tmp_path / 'notes.txt'} (it is a file, and a run is a folder)\n"
