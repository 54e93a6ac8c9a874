"""``datastates-hist import`` of optimizer state dicts that are not plain Adam's: a tensor
lr, tensor betas, LBFGS's lists of tensors, state keys that are not strings. Each is
stored as a live optimizer's write stores it, restores into a fresh optimizer bit-exact,
and trains on as the uninterrupted optimizer does."""

import copy

import pytest
import torch
from torch import nn

import datastates_hist as dh
from datastates_hist.cli import main
from datastates_hist.store import Store
from test_optimizer_kinds import CountingSGD, differences, train_step

STEPS = 3  # trained before the source is saved


def build(kind, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    ps = model.parameters()
    if kind == "adam_tensor_lr":
        opt = torch.optim.Adam(ps, lr=torch.tensor(1e-3))
    elif kind == "adam_tensor_betas":
        opt = torch.optim.Adam(ps, lr=0.01, betas=(torch.tensor(0.9), torch.tensor(0.99)))
    elif kind == "lbfgs":
        opt = torch.optim.LBFGS(ps, lr=0.5, max_iter=4, history_size=3)
    elif kind == "int_keys":
        opt = CountingSGD(ps, lr=0.05, momentum=0.9)
    else:
        raise ValueError(kind)
    return model, opt


KINDS = ["adam_tensor_lr", "adam_tensor_betas", "lbfgs", "int_keys"]


def optim_layout(run, step):
    """The optimizer's stored values and the names of its tensors in ``step`` of ``run``."""
    store = Store(run)
    try:
        with store.open_step(step) as data:
            items = data.values["items"]
            return (items["optim/param_groups"], items["optim/state"],
                    sorted(n for n in data.records if n.startswith("optim/")))
    finally:
        store.close()


@pytest.mark.parametrize("kind", KINDS)
def test_imported_optimizer_state_restores_bit_exact_and_trains_on(tmp_path, backend, kind, capsys):
    model, opt = build(kind, seed=0)
    for s in range(STEPS):
        train_step(model, opt, {}, s)
    source, run, live = tmp_path / f"step_{STEPS}.pt", str(tmp_path / "run"), str(tmp_path / "live")
    saved = copy.deepcopy(opt.state_dict())
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, source)
    assert main(["import", run, str(source), "--backend", backend, "--optimizer-type", type(opt).__qualname__]) == 0
    assert capsys.readouterr().err == ""
    # the layout of a live write of the same optimizer, its parameters unnamed (a dict model)
    with dh.Checkpointer(live, backend=backend) as ckpt:
        ckpt.write(STEPS, dict(model.named_parameters()), opt)
    assert optim_layout(run, STEPS) == optim_layout(live, STEPS)

    fresh, fresh_opt = build(kind, seed=1)
    with dh.Checkpointer(run) as ckpt:
        assert not ckpt.restore(STEPS, model=fresh).problems
        assert not ckpt.restore(STEPS, optimizer=fresh_opt).problems  # parameters by position: no model
    assert differences(fresh_opt.state_dict(), saved) == []
    assert differences(fresh.state_dict(), model.state_dict()) == []

    train_step(model, opt, {}, STEPS)  # the uninterrupted run, and the restored one
    train_step(fresh, fresh_opt, {}, STEPS)
    assert differences(fresh.state_dict(), model.state_dict()) == []
    assert differences(fresh_opt.state_dict(), opt.state_dict()) == []


def test_tensors_nested_in_state_values_import_and_state_keys_that_clash_are_refused(tmp_path, backend, capsys):
    w, buf = torch.ones(2), torch.arange(3.0)
    source, run = tmp_path / "step_1.pt", str(tmp_path / "run")
    # a dict of tensors in a state value; the state of a parameter that no group lists
    optim = {"state": {0: {"buf": {"a": buf}, "n": 2}, 5: {"x": buf + 1}},
             "param_groups": [{"params": [0], "lr": 0.1}]}
    torch.save({"model": {"w": w}, "optimizer": optim}, source)
    assert main(["import", run, str(source), "--backend", backend]) == 0
    assert capsys.readouterr().err == ""
    with dh.open(run) as h:
        assert torch.equal(h.read("optim/state/@0/buf/a", 1), buf)
        assert torch.equal(h.read("optim/state/@5/x", 1), buf + 1)
    assert optim_layout(run, 1)[1] == {"@0": {"buf": {"a": {"__tensor__": "state/@0/buf/a"}}, "n": 2}}
    clashes = {
        "step_2.pt": ({0: {"n": 1}, "0": {"n": 2}}, [0],
                      "the optimizer states 0 and '0' would both be stored as that of parameter '@0'"),
        "step_3.pt": ({0: {"n": 1}}, [3], "the optimizer state 0 is of a parameter that no param group lists, and "
                      "would be stored as that of parameter '@0', which one lists"),
    }
    for name, (state, params, why) in clashes.items():
        source = tmp_path / name
        torch.save({"model": {"w": w}, "optimizer": {"state": state, "param_groups": [{"params": params}]}}, source)
        code = main(["import", str(tmp_path / "other"), str(source), "--backend", backend])
        assert (code, capsys.readouterr().err) == (2, f"datastates-hist: cannot import {source}: {why}\n")
    assert not (tmp_path / "other").exists()
