"""Bit-exact resume: a fresh process restores step 15 of a 30-step run and trains on."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from datastates_hist.store import Store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train_gpt.py")


def train(*args):
    cmd = [sys.executable, TRAIN, "--size", "tiny", "--steps", "31", "--block-size", "32",
           "--batch-size", "4", "--corpus-bytes", str(1 << 20), "--log-every", "100", *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def step_tensors(run_dir, step):
    store = Store(run_dir)
    with store.open_step(step) as data:
        tensors = {name: data.read(name) for name in data.records}
        values = data.values
    store.close()
    return tensors, values


@pytest.mark.parametrize("backend,dtype", [("adios2", "float32"), ("hdf5", "float32"),
                                           ("adios2", "bfloat16")])
def test_resume_from_step_15_equals_uninterrupted_run(tmp_path, backend, dtype):
    full, branch = str(tmp_path / "full"), str(tmp_path / "branch")
    # the uninterrupted run: steps 0..30, checkpointing every step; every 5th stays a restore point
    train("--run-dir", full, "--backend", backend, "--dtype", dtype, "--keep-every", "5")
    shutil.copytree(full, branch)
    # a fresh process restores step 15 and trains steps 16..30 again
    out = train("--run-dir", branch, "--backend", backend, "--dtype", dtype, "--keep-every", "5",
                "--resume-from", "15")
    assert "resumed from step 15" in out
    want, want_values = step_tensors(full, 30)
    got, got_values = step_tensors(branch, 30)
    assert want.keys() == got.keys()
    model = [n for n in want if n.startswith("model/")]
    optim = [n for n in want if n.startswith("optim/")]
    assert len(model) > 10 and len(optim) >= 2 * len(model)
    if dtype == "bfloat16":
        assert want[model[0]].dtype == torch.bfloat16
    for name in want:
        assert want[name].dtype == got[name].dtype and want[name].shape == got[name].shape, name
        a, b = (t.reshape(-1).view(torch.uint8) for t in (want[name], got[name]))
        assert torch.equal(a, b), name
    assert want_values["items"] == got_values["items"]  # scheduler, RNG, data position


def test_restored_parameters_equal_the_live_ones(tmp_path):
    """The last stored step equals the model the run ended with (checked in-process)."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_gpt

    args = train_gpt.build_parser().parse_args(
        ["--size", "tiny", "--steps", "6", "--block-size", "32", "--batch-size", "4",
         "--corpus-bytes", str(1 << 20), "--run-dir", str(tmp_path / "r"), "--log-every", "100"])
    result = train_gpt.train(args)
    assert result["last_step"] == 5
    tensors, values = step_tensors(str(tmp_path / "r"), 5)
    assert values["items"]["extra/data"]["step"] == 5
    assert values["items"]["extra/data"]["loss"] == result["losses"][-1]
