"""Restores that must not be silently wrong: parameter names holding '/', a different
param-group structure, and mismatched objects under ``strict=False``."""

import copy

import pytest
import torch
from torch import nn

import datastates_hist as dh


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def same_state(a: dict, b: dict) -> bool:
    """Optimizer ``state_dict()``s equal: hyper-parameters, and every state tensor bit for bit."""
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    for k, entry in a["state"].items():
        other = b["state"][k]
        if entry.keys() != other.keys():
            return False
        for key, v in entry.items():
            w = other[key]
            if isinstance(v, torch.Tensor) != isinstance(w, torch.Tensor):
                return False
            if not (same_bits(v, w) if isinstance(v, torch.Tensor) else v == w):
                return False
    return True


def frozen(opt: torch.optim.Optimizer) -> dict:
    return copy.deepcopy(opt.state_dict())


def train_step(model, opt, forward, seed):
    gen = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    forward(model, torch.randn(8, 4, generator=gen)).square().mean().backward()
    opt.step()


# --- a parameter name holding '/' ---------------------------------------------------------

def slashed_model(seed):
    torch.manual_seed(seed)
    return nn.ModuleDict({"enc/a": nn.Linear(4, 6), "head": nn.Linear(6, 2)})


def slashed_forward(model, x):
    return model["head"](torch.tanh(model["enc/a"](x)))


def test_slash_in_a_parameter_name_round_trips_optimizer_state(run_dir, backend):
    model = slashed_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for s in range(3):
        train_step(model, opt, slashed_forward, s)
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        ckpt.write(3, model, opt)
    resumed = slashed_model(1)
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=0.01)
    with dh.Checkpointer(run_dir) as ckpt:
        r = ckpt.restore(model=resumed, optimizer=resumed_opt)
    assert not r.problems
    assert "enc/a.weight" in dict(resumed.named_parameters())
    assert same_state(frozen(resumed_opt), frozen(opt))
    assert len(resumed_opt.state) == 4  # every parameter, 'enc/a.*' included
    train_step(model, opt, slashed_forward, 3)
    train_step(resumed, resumed_opt, slashed_forward, 3)
    for (name, p), (_, q) in zip(model.named_parameters(), resumed.named_parameters()):
        assert same_bits(p.detach(), q.detach()), name
    assert same_state(frozen(resumed_opt), frozen(opt))


def test_optimizer_state_key_that_would_read_back_as_another_parameter_is_refused(run_dir):
    model = nn.ParameterDict({"@0/m": nn.Parameter(torch.ones(2))})
    outside = nn.Parameter(torch.ones(2))  # not in the model: named by its position, '@0'
    opt = torch.optim.SGD([outside, model["@0/m"]], lr=0.1)
    opt.state[outside]["m/buf"] = torch.zeros(2)  # item state/@0/m/buf: parameter '@0/m', key 'buf'?
    with dh.Checkpointer(run_dir) as ckpt:
        with pytest.raises(ValueError) as err:
            ckpt.write(0, model, opt)
        assert ckpt.steps() == []
    assert str(err.value) == (
        "cannot checkpoint optimizer state 'm/buf' of parameter '@0': its item name "
        "state/@0/m/buf would read back as state 'buf' of parameter '@0/m'; "
        "rename the state key or the parameter")


# --- the param-group structure ----------------------------------------------------------------

def linear(seed):
    torch.manual_seed(seed)
    return nn.Linear(4, 3)


def linear_forward(model, x):
    return model(x)


def two_group_adamw(model):
    return torch.optim.AdamW([{"params": [model.weight], "weight_decay": 0.1},
                              {"params": [model.bias], "weight_decay": 0.0}], lr=0.01)


def committed_two_groups(run_dir, backend):
    model = linear(0)
    opt = two_group_adamw(model)
    train_step(model, opt, linear_forward, 0)
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        ckpt.write(0, model, opt)
    return model, opt


def test_strict_restore_refuses_another_param_group_count(run_dir, backend):
    committed_two_groups(run_dir, backend)
    target = linear(1)
    target_opt = torch.optim.AdamW(target.parameters(), lr=0.005, weight_decay=0.02)
    train_step(target, target_opt, linear_forward, 7)
    before, weights = frozen(target_opt), copy.deepcopy(target.state_dict())
    with dh.Checkpointer(run_dir) as ckpt:
        with pytest.raises(dh.RestoreMismatchError) as err:
            ckpt.restore(model=target, optimizer=target_opt)
    assert str(err.value) == (
        "step 0 does not match the objects to restore:\n"
        "  optim/param_groups: expected AdamW with 1 param group, found AdamW with 2 param groups\n"
        "pass strict=False to load what matches and get the rest reported")
    assert err.value.mismatched == [("optim/param_groups", "AdamW with 1 param group",
                                     "AdamW with 2 param groups")]
    assert target_opt.param_groups[0]["lr"] == 0.005 and target_opt.param_groups[0]["weight_decay"] == 0.02
    assert same_state(frozen(target_opt), before)
    assert all(same_bits(weights[k], v) for k, v in target.state_dict().items())


def test_strict_restore_refuses_parameters_in_other_groups(run_dir, backend):
    committed_two_groups(run_dir, backend)
    target = linear(1)
    swapped = torch.optim.AdamW([{"params": [target.bias]}, {"params": [target.weight]}], lr=0.01)
    before = frozen(swapped)
    with dh.Checkpointer(run_dir) as ckpt:
        with pytest.raises(dh.RestoreMismatchError) as err:
            ckpt.restore(model=target, optimizer=swapped)
    assert err.value.mismatched == [("optim/param bias", "in param group 0", "in param group 1"),
                                    ("optim/param weight", "in param group 1", "in param group 0")]
    assert "  optim/param bias: expected in param group 0, found in param group 1\n" in str(err.value)
    assert same_state(frozen(swapped), before)


# --- strict=False leaves mismatched objects as they were ----------------------------------

def test_non_strict_leaves_an_optimizer_of_another_type_and_loads_the_rest(run_dir, backend):
    model = linear(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.001)
    train_step(model, opt, linear_forward, 0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    counter = torch.arange(5.0)
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        ckpt.write(0, model, opt, sched=sched, counter=counter)
    target = linear(1)
    sgd = torch.optim.SGD(target.parameters(), lr=0.1, momentum=0.9)
    train_step(target, sgd, linear_forward, 7)  # SGD holds momentum buffers
    other_sched = torch.optim.lr_scheduler.ExponentialLR(sgd, gamma=0.5)
    other_counter = torch.zeros(5)
    before, sched_before = frozen(sgd), copy.deepcopy(other_sched.state_dict())
    with dh.Checkpointer(run_dir) as ckpt:
        r = ckpt.restore(model=target, optimizer=sgd, sched=other_sched, counter=other_counter,
                         strict=False)
    assert same_state(frozen(sgd), before)
    assert sgd.param_groups[0]["lr"] == 0.1 and set(sgd.state[target.weight]) == {"momentum_buffer"}
    assert other_sched.state_dict() == sched_before
    for name, p in model.named_parameters():  # the model, and the matching extra, are loaded
        assert same_bits(p.detach(), dict(target.named_parameters())[name].detach()), name
    assert same_bits(other_counter, counter)
    assert r.problems.missing == [] and r.problems.unexpected == []
    assert r.problems.mismatched == [("optim/param_groups", "SGD", "Adam"),
                                     ("extra/sched", "ExponentialLR", "StepLR")]
    assert r.skipped == ["optim", "extra/sched"]
    assert r.extra["sched"] is other_sched and r.extra["counter"] is other_counter


def test_non_strict_leaves_an_optimizer_of_another_group_count(run_dir, backend):
    model, _ = committed_two_groups(run_dir, backend)
    target = linear(1)
    target_opt = torch.optim.AdamW(target.parameters(), lr=0.005, weight_decay=0.02)
    train_step(target, target_opt, linear_forward, 7)
    before = frozen(target_opt)
    with dh.Checkpointer(run_dir) as ckpt:
        r = ckpt.restore(model=target, optimizer=target_opt, strict=False)
    assert same_state(frozen(target_opt), before)
    assert all(same_bits(v, target.state_dict()[k]) for k, v in model.state_dict().items())
    assert r.problems.mismatched == [("optim/param_groups", "AdamW with 1 param group",
                                      "AdamW with 2 param groups")]
    assert r.skipped == ["optim"]


def test_non_strict_skips_the_state_of_a_reshaped_parameter_only(run_dir, backend):
    def forward(m, x):
        return m(x)[:, :2]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for s in range(2):
        train_step(model, opt, forward, s)
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        ckpt.write(2, model, opt)
    torch.manual_seed(1)
    target = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 5))  # layer 1 reshaped
    target_opt = torch.optim.Adam(target.parameters(), lr=0.02)
    train_step(target, target_opt, forward, 7)
    own = {n: copy.deepcopy(target_opt.state[p]) for n, p in target.named_parameters()}
    with dh.Checkpointer(run_dir) as ckpt:
        r = ckpt.restore(model=target, optimizer=target_opt, strict=False)
    assert target_opt.param_groups[0]["lr"] == 0.01  # the group's hyper-parameters load
    saved = dict(model.named_parameters())
    for name, p in target.named_parameters():
        state = target_opt.state[p]
        # a reshaped parameter keeps its own state whole; the others get the stored one
        want = own[name] if name.startswith("1.") else opt.state[saved[name]]
        assert state.keys() == want.keys(), name
        assert all(same_bits(state[k], want[k]) for k in state), name
    assert sorted(n for n, _, _ in r.problems.mismatched) == [
        "model/1.bias", "model/1.weight", "optim/state/1.bias/exp_avg", "optim/state/1.bias/exp_avg_sq",
        "optim/state/1.weight/exp_avg", "optim/state/1.weight/exp_avg_sq"]
    assert r.skipped == []
    train_step(target, target_opt, forward, 8)  # every state is whole: the optimizer steps on


class Counter:
    def __init__(self, n=0):
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


@pytest.mark.parametrize("passed, stored", [
    (lambda opt: torch.zeros(1), "extra/sched: expected a Tensor (TreeProvider), found the state of an object "
                                 "with state_dict()"),
    (lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2), "extra/epoch: expected a StepLR (StateDictProvider), "
                                                          "found the state of a plain value or tensor"),
    (lambda opt: {}, "extra/sched: expected a dict (TreeProvider), found the state of an object with state_dict()"),
])
def test_an_extra_of_another_kind_than_the_stored_one_is_a_mismatch(run_dir, passed, stored):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(0, model, opt, sched=torch.optim.lr_scheduler.StepLR(opt, 2), epoch=3)
        key = stored.split(":")[0].removeprefix("extra/")
        target = passed(opt)
        with pytest.raises(dh.RestoreMismatchError) as caught:
            ckpt.restore(0, model, opt, **{key: target})
        assert str(caught.value).splitlines()[1] == f"  {stored}"
        restored = ckpt.restore(0, model, opt, strict=False, **{key: target})
        assert restored.skipped == [f"extra/{key}"] and restored.extra[key] is target
        assert restored.extra["epoch" if key == "sched" else "sched"] is not None  # the other one rebuilt


def test_an_optimizer_restored_without_its_model_is_refused(run_dir):
    model = nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(0, model, opt)
        with pytest.raises(TypeError, match=r"^restore\(\) of an optimizer needs the model: the optimizer's state "
                                            r"is matched to its parameters by their names in the model"):
            ckpt.restore(0, optimizer=opt)


def test_a_failing_load_state_dict_says_which_extra_and_what_was_loaded_before(run_dir):
    class Refuses(Counter):
        def load_state_dict(self, state):
            raise ValueError("cannot load")

    model = nn.Linear(2, 2)
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(0, model, sampler=Counter(4), bad=Refuses(5))
        with pytest.raises(ValueError) as caught:
            ckpt.restore(0, model, sampler=Counter(), bad=Refuses())
    assert caught.value.args == ("cannot load",)
    assert caught.value.__notes__ == ["datastates-hist: raised while loading 'extra/bad' of step 0, after 'model', "
                                      "'rng', 'extra/sampler' had been loaded"]


def test_a_numpy_array_is_restored_in_place_like_a_tensor(run_dir, backend):
    import numpy as np

    model = nn.Linear(2, 2)
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        ckpt.write(0, model, arr=np.arange(3.0), t=torch.arange(4.0))
        live, into = np.zeros(3), np.zeros(4, dtype=np.float32)
        restored = ckpt.restore(0, model, arr=live, t=into)
        assert restored.extra["arr"] is live and live.tolist() == [0.0, 1.0, 2.0]
        assert restored.extra["t"] is into and into.tolist() == [0.0, 1.0, 2.0, 3.0]
        other = np.zeros(5)
        with pytest.raises(dh.RestoreMismatchError) as caught:
            ckpt.restore(0, model, arr=other)
        assert str(caught.value).splitlines()[1] == "  extra/arr: expected float64[5], found float64[3]"
        assert not other.any()


def test_a_0d_array_written_before_format_6_restores_into_a_0d_array(run_dir):
    """Format 5 stored np.array(0.5) as a tensor of shape [1]; a 0-d array takes it."""
    import numpy as np

    model = nn.Linear(2, 2)
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(0, model, ema=np.array([0.5]))  # what format 5 wrote for np.array(0.5)
        ema = np.zeros(())
        assert ckpt.restore(0, model, ema=ema).extra["ema"] is ema and ema.shape == () and float(ema) == 0.5
        with pytest.raises(dh.RestoreMismatchError) as caught:
            ckpt.restore(0, model, ema=np.zeros((), dtype=np.float32))
        assert str(caught.value).splitlines()[1] == "  extra/ema: expected float32[], found float64[1]"


def test_an_extra_passed_as_none_is_rebuilt(run_dir):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(0, model, opt, sched=torch.optim.lr_scheduler.StepLR(opt, 2))
        assert ckpt.restore(0, model, opt, sched=None).extra["sched"]["step_size"] == 2


def test_an_optimizer_of_unnamed_parameters_restores_without_a_model(run_dir):
    """A model that is a plain dict names no parameters: the optimizer's state is by position."""
    weights = {"w": torch.nn.Parameter(torch.ones(3))}
    opt = torch.optim.Adam(weights.values())
    weights["w"].grad = torch.ones(3)
    opt.step()
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(0, weights, opt)
        fresh = torch.optim.Adam([torch.nn.Parameter(torch.zeros(3))])
        ckpt.restore(0, optimizer=fresh)
    assert same_state(fresh.state_dict(), opt.state_dict())
