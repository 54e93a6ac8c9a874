"""The command line on runs that hold NaN, on read-only runs, and when things go wrong:
every error is one line on stderr with a documented exit code, never a traceback."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import datastates_hist as dh
from datastates_hist.cli import EXIT_BUG, EXIT_IO, outcome
from datastates_hist.cli.output import size
from datastates_hist.layout import unit_bytes
from test_bad_inputs import read_only


def cli(*args, stdout=subprocess.PIPE):
    return subprocess.run([sys.executable, "-m", "datastates_hist.cli", *args],
                          stdout=stdout, stderr=subprocess.PIPE, text=True)


def step_sizes(run_dir):
    """The bytes each step's data takes on disk (what deleting it frees), in step order."""
    steps = os.path.join(run_dir, "steps")
    return [unit_bytes(os.path.join(steps, unit)) for unit in sorted(os.listdir(steps))]


def run_with_nan(run_dir):
    """Steps 0 and 1 identical, both with a NaN in the weight; step 2 changes one number."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight[1, 2] = math.nan
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(0, model)
        ckpt.write(1, model)
        ckpt.wait()
        with torch.no_grad():
            model.weight[0, 0] += 2.0
        ckpt.write(2, model)
    return model


def test_trace_prints_nan_statistics_as_blanks(run_dir):
    run_with_nan(run_dir)
    out = cli("trace", run_dir, "weight", "--json")
    assert out.returncode == 0 and out.stderr == ""
    assert json.loads(out.stdout)["values"] == [None, None, None]  # the norm of a tensor holding NaN
    out = cli("trace", run_dir, "weight")
    assert out.returncode == 0 and out.stderr == ""
    rows = [line.split() for line in out.stdout.strip().splitlines()]
    assert rows[:4] == [["step", "weight", "norm"], ["0"], ["1"], ["2"]]
    out = cli("trace", run_dir, "bias", "--json")  # the statistics of a finite tensor are numbers
    with dh.open(run_dir) as h:
        bias = h.read("model/bias", 0).double()
    assert json.loads(out.stdout)["values"] == [pytest.approx(float(bias.norm()))] * 3


def test_diff_counts_nan_in_both_steps_as_unchanged(run_dir):
    run_with_nan(run_dir)
    out = cli("diff", run_dir, "0", "1", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    weight = rows["model/weight"]
    assert (weight["l2"], weight["rel_l2"], weight["max_abs"], weight["frac_changed"]) == (0.0, 0.0, 0.0, 0.0)
    out = cli("diff", run_dir, "1", "2", "--json")
    weight = {r["name"]: r for r in json.loads(out.stdout)}["model/weight"]
    assert weight["frac_changed"] == pytest.approx(1 / 12)
    assert weight["l2"] == pytest.approx(2.0) and weight["max_abs"] == pytest.approx(2.0)


def committed_run(run_dir, steps=(0, 1, 2), codec="delta"):
    with dh.Checkpointer(run_dir, codec=codec) as ckpt:
        for step in steps:
            ckpt.write(step, torch.nn.Linear(4, 3))


def test_prune_dry_run_only_reads_a_read_only_run(tmp_path):
    run = str(tmp_path / "ro" / "run")
    with read_only(str(tmp_path / "ro")) as freeze:
        committed_run(run, codec="key")  # no delta bases: the rule alone decides
        freeze()
        before = sorted(os.listdir(os.path.join(run, "steps")))
        sizes = step_sizes(run)
        out = cli("prune", run, "--keep-last", "1", "--dry-run")
        assert out.returncode == 0 and out.stderr == ""
        assert out.stdout == f"would delete 2 steps; 1 kept; would free {size(sizes[0] + sizes[1])} (steps 0, 1)\n"
        out = cli("prune", run, "--keep-last", "1", "--dry-run", "--json")
        assert json.loads(out.stdout) == {"removed": [0, 1], "kept": [2], "bytes": sizes[0] + sizes[1],
                                          "dry_run": True, "freed": [{"step": 0, "bytes": sizes[0]},
                                                                     {"step": 1, "bytes": sizes[1]}],
                                          "bases": [], "kept_restore_point": None}
        out = cli("prune", run, "--keep-last", "1")
        assert out.returncode == EXIT_IO
        assert out.stderr == f"datastates-hist: the run directory {run} is not writable: read-only file system\n"
        with pytest.raises(PermissionError) as info:
            dh.Checkpointer(run)
        assert str(info.value) == f"the run directory {run} is not writable: read-only file system"
        assert sorted(os.listdir(os.path.join(run, "steps"))) == before


def test_prune_reports_bytes_it_deleted(run_dir):
    committed_run(run_dir, steps=(0, 1, 2, 3), codec="key")
    sizes = step_sizes(run_dir)
    out = cli("prune", run_dir, "--keep-every", "2", "--json")
    assert json.loads(out.stdout) == {"removed": [1], "kept": [0, 2, 3], "bytes": sizes[1], "dry_run": False,
                                      "freed": [{"step": 1, "bytes": sizes[1]}], "bases": [], "kept_restore_point": None}


@pytest.mark.parametrize("args, code, message", [
    (["show", "{run}", str(2**63)], 2, "datastates-hist show: error: argument step: '9223372036854775808' is not a step "
     "(a whole number from 0 to 2**63-1, latest, or -N for the Nth newest)"),
    (["export", "{run}", "0", "--to", "{tmp}/no/such/folder/out.pt"], EXIT_IO,
     "datastates-hist: cannot write {tmp}/no/such/folder/out.pt: there is no folder {tmp}/no/such/folder"),
    (["diff", "{run}", "0", str(2**64)], 2,
     f"datastates-hist: diff: '{2**64}' is not a step (a whole number from 0 to 2**63-1, latest, "
     "or -N for the Nth newest)"),
    (["verify", "{run}", "7"], 3, "datastates-hist: step 7 is not committed in {run} (committed steps: 0..2 (3))"),
    # int() takes these, a step is digits only
    (["show", "{run}", "1_0"], 2, "datastates-hist show: error: argument step: '1_0' is not a step "
     "(a whole number from 0 to 2**63-1, latest, or -N for the Nth newest)"),
    (["show", "{run}", "-0"], 2, "datastates-hist show: error: argument step: '-0' is not a step "
     "(a whole number from 0 to 2**63-1, latest, or -N for the Nth newest)"),
    (["show", "{run}", "\u0661"], 2, "datastates-hist show: error: argument step: '\u0661' is not a step "
     "(a whole number from 0 to 2**63-1, latest, or -N for the Nth newest)"),
    (["diff", "{run}", "0", "1", "--top", " 2"], 2, "datastates-hist diff: error: argument --top: ' 2' is not a count "
     "(a whole number from 1)"),
])
def test_errors_are_one_line_with_their_exit_code(tmp_path, run_dir, args, code, message):
    committed_run(run_dir)
    fill = {"run": run_dir, "tmp": str(tmp_path)}
    out = cli(*[a.format(**fill) for a in args])
    assert out.returncode == code
    assert out.stderr.strip().splitlines()[-1] == message.format(**fill) and "Traceback" not in out.stderr


def test_the_newest_step_of_a_run_without_steps_is_named_as_missing(run_dir):
    dh.Checkpointer(run_dir).close()
    for step in ("latest", "-2"):
        out = cli("show", run_dir, step)
        assert (out.returncode, out.stderr) == (3, f"datastates-hist: {run_dir} has no committed steps\n")


def test_output_to_a_closed_pipe_ends_quietly(run_dir):
    committed_run(run_dir)
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will read: the first write of the output fails
    try:
        out = cli("ls", run_dir, stdout=write_end)
    finally:
        os.close(write_end)
    assert out.returncode == EXIT_IO and out.stderr == ""


def test_an_unexpected_error_is_reported_as_a_bug():
    assert outcome(ZeroDivisionError("division by zero")) == (
        EXIT_BUG, "unexpected error, please report it: ZeroDivisionError: division by zero")
    assert outcome(SystemExit(3)) == (None, "")
