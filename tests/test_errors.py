"""Bad input gets a clear error that names what is wrong; nothing committed is lost."""

import os

import pytest
import torch

import datastates_hist as dh


def linear():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def committed(run_dir, steps=(0,), model=None):
    model = model or linear()
    with dh.Checkpointer(run_dir) as ckpt:
        for s in steps:
            ckpt.write(s, model, torch.optim.SGD(model.parameters(), lr=0.1))
    return model


def test_missing_run_and_empty_run(tmp_path):
    from datastates_hist.store import Store

    with pytest.raises(dh.StoreNotFoundError, match="no run at"):
        Store(str(tmp_path / "nope"))
    with dh.Checkpointer(tmp_path / "empty") as ckpt:
        assert ckpt.steps() == []
        with pytest.raises(dh.StepNotFoundError, match="has no committed steps"):
            ckpt.restore(model=linear())


def test_step_that_does_not_exist(run_dir):
    committed(run_dir, steps=(0, 1, 2))
    with dh.Checkpointer(run_dir) as ckpt:
        with pytest.raises(dh.StepNotFoundError, match=r"step 7 is not committed .*0\.\.2 \(3\)"):
            ckpt.restore(7, model=linear())


def test_path_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file, not a run directory"):
        dh.Checkpointer(path)


def test_steps_only_grow(run_dir):
    committed(run_dir, steps=(0, 5))
    with dh.Checkpointer(run_dir) as ckpt:
        with pytest.raises(dh.StepOrderError, match="step 5 is not after step 5"):
            ckpt.write(5, linear())
        with pytest.raises(dh.StepOrderError, match="step 3 is not after step 5"):
            ckpt.write(3, linear())
        with pytest.raises(ValueError, match="non-negative int"):
            ckpt.write(-1, linear())
        assert ckpt.steps() == [0, 5]


def test_two_writers_on_one_run(run_dir):
    with dh.Checkpointer(run_dir):
        with pytest.raises(dh.StoreLockedError) as err:  # the same process: it says how to go on
            dh.Checkpointer(run_dir)
    assert str(err.value) == (f"{run_dir} is being written by a Checkpointer of this process that was not closed; "
                              "one writer per run (close it first: ckpt.close(), or use it in a with block)")


def test_strict_restore_lists_every_problem_and_changes_nothing(run_dir):
    committed(run_dir)
    other = torch.nn.Sequential(torch.nn.Linear(4, 5))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with dh.Checkpointer(run_dir) as ckpt:
        with pytest.raises(dh.RestoreMismatchError) as err:
            ckpt.restore(model=other)
    text = str(err.value)
    assert "missing from the step (2): model/0.weight, model/0.bias" in text
    assert "unexpected in the step (2): model/weight, model/bias" in text
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_shape_and_dtype_mismatch_named(run_dir):
    committed(run_dir)
    wider = torch.nn.Linear(4, 5)
    with dh.Checkpointer(run_dir) as ckpt:
        with pytest.raises(dh.RestoreMismatchError, match=r"model/weight: expected float32\[5, 4\], found float32\[3, 4\]"):
            ckpt.restore(model=wider)
        with pytest.raises(dh.RestoreMismatchError, match=r"model/weight: expected float64\[3, 4\]"):
            ckpt.restore(model=torch.nn.Linear(4, 3).double())


def test_non_strict_loads_what_matches_and_reports_the_rest(run_dir):
    saved = committed(run_dir)
    target = torch.nn.Linear(4, 5)
    before = target.weight.detach().clone()
    with dh.Checkpointer(run_dir) as ckpt:
        r = ckpt.restore(model=target, strict=False)
    assert torch.equal(target.weight, before)  # mismatched tensors are left as they were
    assert [m[0] for m in r.problems.mismatched] == ["model/weight", "model/bias"]
    small = torch.nn.Linear(4, 3)
    with dh.Checkpointer(run_dir) as ckpt:
        r = ckpt.restore(model=small, strict=False)
    assert not r.problems and torch.equal(small.weight, saved.weight)


def test_optimizer_of_another_type(run_dir):
    committed(run_dir)
    model = linear()
    with dh.Checkpointer(run_dir) as ckpt:
        with pytest.raises(dh.RestoreMismatchError, match="optim/param_groups: expected Adam, found SGD"):
            ckpt.restore(model=model, optimizer=torch.optim.Adam(model.parameters()))


def test_optimizer_state_follows_names_not_positions(run_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(0, model, opt)
    reordered = torch.optim.Adam(list(model.parameters())[::-1])
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.restore(model=model, optimizer=reordered)
    for p in model.parameters():
        assert torch.equal(reordered.state[p]["exp_avg"], opt.state[p]["exp_avg"])


def test_unsupported_values_and_tensors(run_dir):
    with dh.Checkpointer(run_dir) as ckpt:
        with pytest.raises(TypeError, match=r"cannot checkpoint 'extra/cfg'.*type builtins.object cannot be stored without pickle"):
            ckpt.write(0, linear(), cfg={"x": object()})
        with pytest.raises(ValueError, match="'extra/w' is on the meta device"):
            ckpt.write(0, linear(), w=torch.empty(3, device="meta"))
        with pytest.raises(TypeError, match="'extra/s' has layout torch.sparse_coo"):
            ckpt.write(0, linear(), s=torch.eye(3).to_sparse())
        with pytest.raises(TypeError, match="needs a model"):
            ckpt.write(0, None)
        with pytest.raises(ValueError) as clash:  # both tensors would be stored as data/a/1
            ckpt.write(0, linear(), data={"a": {1: torch.ones(1), "1": torch.zeros(1)}})
        assert str(clash.value) == ("cannot checkpoint 'extra/data': value/a/1: two entries would be stored "
                                    "under this name (keys that differ only in type, such as 1 and '1')")
        assert ckpt.steps() == []


def test_unknown_backend(run_dir):
    with pytest.raises(ValueError, match="unknown backend 'zarr'; available: adios2, hdf5"):
        dh.Checkpointer(run_dir, backend="zarr")


def test_newer_format_version_is_refused(run_dir):
    committed(run_dir)
    import sqlite3

    conn = sqlite3.connect(os.path.join(run_dir, "index.sqlite"))
    with conn:
        conn.execute("UPDATE meta SET value='99' WHERE key='format_version'")
    conn.close()
    with pytest.raises(dh.FormatError, match="format version 99.*upgrade datastates-hist"):
        dh.Checkpointer(run_dir)


def test_closed_checkpointer(run_dir):
    ckpt = dh.Checkpointer(run_dir)
    ckpt.write(0, linear())
    ckpt.close()
    calls = [lambda: ckpt.write(1, linear()), lambda: ckpt.restore(model=linear()), ckpt.steps,
             lambda: ckpt.truncate(0), lambda: ckpt.prune(keep_last=1)]
    for call in calls:  # not a damaged index: the index was closed with the Checkpointer
        with pytest.raises(RuntimeError) as info:
            call()
        assert str(info.value) == f"the Checkpointer of {run_dir} is closed"
    ckpt.close()  # a second close does nothing
    with dh.open(run_dir) as h:
        assert h.steps == [0]
