"""Runs written by the code of each earlier format version (1-5), on both backends, read,
restored and continued by today's code. What today's code gives back is compared with what
the old code gave back from the same run right after writing it (expected.json); how the runs
were made: tests/fixtures/old_formats/README.md."""
import json
import os
import shutil
import sqlite3
import tarfile

import pytest
import torch

import datastates_hist as dh
from datastates_hist.index import FORMAT_VERSION
from datastates_hist.verify import verify_run
from old_formats import describe, describe_rng, extras, make, train_step

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "old_formats")
with open(os.path.join(FIXTURES, "expected.json")) as _f:
    EXPECTED = json.load(_f)
CASES = sorted(EXPECTED)  # "v1/adios2", ..., "v5/hdf5"


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    root = tmp_path_factory.mktemp("old_formats")
    with tarfile.open(os.path.join(FIXTURES, "runs.tar.xz")) as tar:
        tar.extractall(root, filter="data")
    return root


@pytest.fixture(params=CASES)
def case(request, extracted, tmp_path):
    """(a copy of the run, what the old code gave back from it)."""
    run = str(tmp_path / "run")
    shutil.copytree(os.path.join(extracted, request.param, "run"), run)
    return run, EXPECTED[request.param]


def run_format(run):
    con = sqlite3.connect(f"file:{run}/index.sqlite?mode=ro", uri=True)
    try:
        return int(con.execute("SELECT value FROM meta WHERE key='format_version'").fetchone()[0])
    finally:
        con.close()


def assert_reads(h, old, steps):
    for step in steps:
        tensors = old["tensors"][str(step)]
        assert sorted(h.names(step)) == sorted(tensors), step
        for name, want in tensors.items():
            assert describe(h.read(name, step)) == want, (step, name)


def test_reads_as_the_old_code_did(case):
    run, old = case
    with dh.open(run) as h:
        assert h.steps == old["steps"]
        assert h.restore_points == old["restore_points"]
        assert_reads(h, old, h.steps)
    assert verify_run(run) == []
    assert run_format(run) == old["format_version"]  # reading upgrades nothing


def test_restores_as_the_old_code_did(case):
    run, old = case
    ckpt = dh.Checkpointer(run)
    try:
        for step in old["restore_points"]:
            want = old["restores"][str(step)]
            model, opt, sched = make(seed=123)
            result = ckpt.restore(step, model=model, optimizer=opt, scheduler=sched)
            assert result.step == want["step"] == step
            assert describe(model.state_dict()) == want["model"], step
            assert describe(opt.state_dict()) == want["optim"], step
            assert describe(sched.state_dict()) == want["sched"], step
            assert result.extra["scheduler"] is sched
            rest = {k: v for k, v in result.extra.items() if k != "scheduler"}
            assert describe(rest) == want["extra"], step
            assert {k: type(v).__name__ for k, v in result.extra.items()} == want["extra_types"]
            assert describe_rng() == want["rng"], step
        for step in sorted(set(old["steps"]) - set(old["restore_points"])):
            with pytest.raises(dh.StepNotFoundError, match=f"step {step} of .* is a trajectory point"):
                ckpt.restore(step, model=make()[0])
    finally:
        ckpt.close()


def test_training_continues_from_the_newest_restore_point(case):
    run, old = case
    ckpt = dh.Checkpointer(run)
    model, opt, sched = make(seed=999)
    assert ckpt.restore(model=model, optimizer=opt, scheduler=sched).step == old["restore_points"][-1]
    written = {}
    first = old["steps"][-1] + 1
    for step in range(first, first + 2):
        loss = train_step(model, opt, sched)
        ckpt.write(step, model, opt, scheduler=sched, **extras(step, loss))
        written[step] = (describe(model.state_dict()), describe(opt.state_dict()))
    ckpt.close()
    assert run_format(run) == FORMAT_VERSION

    with dh.open(run) as h:
        assert h.steps == old["steps"] + sorted(written)
        assert_reads(h, old, old["steps"])
    assert verify_run(run) == []
    ckpt = dh.Checkpointer(run)
    try:
        for step, (model_state, optim_state) in written.items():
            model, opt, sched = make(seed=5)
            ckpt.restore(step, model=model, optimizer=opt, scheduler=sched)
            assert describe(model.state_dict()) == model_state
            assert describe(opt.state_dict()) == optim_state
    finally:
        ckpt.close()


def test_the_description_tells_values_apart():
    """The comparison above is only as good as describe(): types, dtypes, signs of zero and
    every bit of a tensor count."""
    t = torch.arange(4, dtype=torch.float32)
    u = t.clone()
    u[2] = torch.nextafter(u[2], torch.tensor(9.0))
    assert describe(t) == describe(t.clone())
    assert describe(t) != describe(u)
    assert describe(t) != describe(t.double())
    assert describe(t) != describe(t.reshape(2, 2))
    assert describe(0.0) != describe(-0.0)
    assert describe(1) != describe(1.0) != describe(True)
    assert describe((1, 2)) != describe([1, 2])
    assert describe({"a": 1}) != describe({"a": 1, "b": None})
    assert describe(float("nan")) == describe(float("nan"))
