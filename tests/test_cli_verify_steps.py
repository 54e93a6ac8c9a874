"""``datastates-hist verify RUN STEP...`` takes steps as the reading commands do: a
committed step, ``latest``, or a negative number counting back from the newest; an
unknown step is a one-line error with exit code 3, a step that is no number one with
exit code 2."""

import json
import subprocess
import sys

import pytest
import torch

import datastates_hist as dh
from datastates_hist.cli import EXIT_MISSING, EXIT_USAGE
from datastates_hist.cli.output import size


def cli(*args):
    return subprocess.run([sys.executable, "-m", "datastates_hist.cli", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Steps 0, 1, 2; step s holds 3 + s tensors (so a count of tensors tells which was checked)."""
    path = str(tmp_path_factory.mktemp("verify") / "run")
    model = torch.nn.Linear(3, 2)
    with dh.Checkpointer(path) as ckpt:
        for step in (0, 1, 2):
            ckpt.write(step, model, buffers={f"b{i}": torch.zeros(4) for i in range(step)})
    return path


def checked(run, *steps):
    """(steps, tensors) that ``verify --json`` checked."""
    out = cli("verify", run, *steps, "--json")
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    summary = json.loads(out.stdout)
    assert summary["problems"] == []
    return summary["steps"], summary["tensors"]


def test_verify_takes_latest_and_negative_steps(run):
    with dh.open(run) as h:
        tensors = {step: len(h.names(step)) for step in h.steps}
    assert tensors == {0: 3, 1: 4, 2: 5}
    assert checked(run, "latest") == checked(run, "-1") == checked(run, "2") == (1, 5)
    assert checked(run, "-3") == (1, 3)
    assert checked(run, "-2", "0") == (2, 4 + 3)
    assert checked(run, "-1", "2", "latest") == (1, 5)  # one step named three ways is checked once
    assert checked(run) == (3, 3 + 4 + 5)
    nbytes = json.loads(cli("verify", run, "2", "--json").stdout)["bytes"]
    out = cli("verify", run, "latest")
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout == f"verified 1 step, 5 tensors, {size(nbytes)} of {run}: every checksum matches\n"


@pytest.mark.parametrize("step", ["7", "-4"])
def test_verify_of_a_step_the_run_does_not_hold_says_which_it_holds(run, step):
    out = cli("verify", run, "0", step)
    assert (out.returncode, out.stdout) == (EXIT_MISSING, "")
    assert out.stderr == f"datastates-hist: step {step} is not committed in {run} (committed steps: 0..2 (3))\n"


def test_verify_of_a_step_that_is_no_number_is_a_usage_error(run):
    out = cli("verify", run, "newest")
    assert (out.returncode, out.stdout) == (EXIT_USAGE, "")
    assert out.stderr.splitlines()[-1] == ("datastates-hist verify: error: argument STEP: 'newest' is not a step "
                                           "(a whole number from 0 to 2**63-1, latest, "
                                           "or -N for the Nth newest)")
