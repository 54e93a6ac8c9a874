"""Optimizers whose state is not Adam's: factored moments of another shape than the
parameter (Adafactor), lists of tensors (LBFGS), tensor hyper-parameters (a tensor lr,
tensor betas), state keys that are not strings; and the state of a sharded (DTensor)
parameter written by 2 ranks, restored on 1.

Each kind trains, is written, trains on; a fresh process restores the step into a model
and an optimizer built from another seed and trains on: losses, weights and the whole
optimizer state are bit-identical to the uninterrupted run.

This file is also the job those tests launch: ``python test_optimizer_kinds.py resume
OUT RUN:KIND...``, ``... sharded-write RUN BACKEND`` (under torchrun) and
``... sharded-restore RUN``.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import datastates_hist as dh
from datastates_hist.store import Store

HERE = os.path.abspath(__file__)
WRITTEN = 3  # steps 0..2 trained, step 2 written
MORE = 4  # steps trained after it


# --- the optimizers ------------------------------------------------------------------------

class CountingSGD(torch.optim.SGD):
    """SGD with momentum whose per-parameter state also has int keys: ``0`` a step count
    that shrinks the weights (so that a count restarted would change the training), ``1``
    a tensor of it; and a tuple holding a string."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state[0] = state.get(0, 0) + 1
                state[1] = torch.tensor(state[0] / 7.0)
                state["note"] = ("count", str(state[0]))  # a string, which load_state_dict alone mangles
                p.mul_(1 - 1e-3 * state[1])
        return loss


class History(torch.optim.Optimizer):
    """Steps along the mean of each parameter's last ``depth`` gradients, kept flattened:
    state of another shape than the parameter's, set by a hyper-parameter."""

    def __init__(self, params, lr=0.1, depth=2):
        super().__init__(params, {"lr": lr, "depth": depth})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "past" not in state:
                    state["past"] = torch.zeros(group["depth"], p.numel())
                state["past"] = torch.cat([p.grad.reshape(1, -1), state["past"][:-1]])
                p.sub_(group["lr"] * state["past"].mean(0).view_as(p))


class RowScaled(torch.optim.Optimizer):
    """Momentum (of the parameter's shape) over the root of each row's summed squared
    gradients (``rows``: ``[n, 1]``), for 2-D parameters, sharded or not."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state, g = self.state[p], p.grad
                if not state:
                    state["m"] = torch.zeros_like(p)
                    state["rows"] = torch.zeros_like(g.sum(dim=1, keepdim=True))
                state["m"].mul_(0.9).add_(g)
                state["rows"].add_(g.square().sum(dim=1, keepdim=True))
                p.sub_(group["lr"] * state["m"] / (state["rows"].sqrt() + 1e-8))


def build(kind: str, seed: int):
    """The model, optimizer and extras of one kind (``seed``: the model's initialization)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    ps = model.parameters()
    extra = {}
    if kind == "adafactor":
        opt = torch.optim.Adafactor(ps, lr=0.02)
    elif kind == "lbfgs":
        opt = torch.optim.LBFGS(ps, lr=0.5, max_iter=4, history_size=3)
    elif kind == "adam_tensor_lr":
        opt = torch.optim.Adam(ps, lr=torch.tensor(0.01))
        extra["sched"] = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)  # sets the tensor in place
    elif kind == "adamw_tensor_betas":
        opt = torch.optim.AdamW(ps, lr=0.01, betas=(torch.tensor(0.9), torch.tensor(0.99)), weight_decay=0.1)
    elif kind == "int_keys":
        opt = CountingSGD(ps, lr=0.05, momentum=0.9)
    elif kind == "history":
        opt = History(ps, lr=0.1, depth=2)
    else:
        raise ValueError(kind)
    return model, opt, extra


KINDS = ["adafactor", "lbfgs", "adam_tensor_lr", "adamw_tensor_betas", "int_keys", "history"]


def train_step(model, opt, extra, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)

    def closure():
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        return loss

    if isinstance(opt, torch.optim.LBFGS):
        loss = opt.step(closure)  # evaluates the closure several times
    else:
        loss = closure()
        opt.step()
    if "sched" in extra:
        extra["sched"].step()
    return loss.detach().clone()


def outcome(model, opt, losses) -> dict:
    """What a run ends with: its losses, weights and the optimizer's whole state dict."""
    return {"losses": torch.stack(losses), "weights": copy.deepcopy(model.state_dict()),
            "optim": copy.deepcopy(opt.state_dict())}


def resume(out: str, runs: list[str]) -> None:
    """In a fresh process: restore each ``RUN:KIND`` into a model and optimizer of another
    seed, train on, and save the outcomes."""
    results = {}
    for spec in runs:
        run, kind = spec.rsplit(":", 1)
        model, opt, extra = build(kind, seed=1)
        with dh.Checkpointer(run) as ckpt:
            r = ckpt.restore(WRITTEN - 1, model, opt, **extra)
        assert r.step == WRITTEN - 1 and not r.problems
        results[kind] = outcome(model, opt, [train_step(model, opt, extra, s) for s in range(WRITTEN, WRITTEN + MORE)])
    torch.save(results, out)


# --- comparing bit for bit -----------------------------------------------------------------

def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def differences(a, b, path="") -> list[str]:
    """Where ``a`` and ``b`` differ: types (of dict keys too), tensor bits, values (dicts'
    keys in any order: a restored optimizer's state has its tensors after its other values)."""
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, torch.Tensor):
        return [] if same_bits(a, b) else [f"{path}: tensors differ"]
    if isinstance(a, dict):
        keys_a, keys_b = {(type(k), k) for k in a}, {(type(k), k) for k in b}  # in any order
        if keys_a != keys_b:
            return [f"{path}: keys {list(a)} != {list(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}/{k!r}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}/{i}")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


# --- resumed training, bit-exact -------------------------------------------------------------

@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Per backend: the uninterrupted run of every kind, and its resumption by a fresh process."""
    done = {}

    def get(backend):
        if backend not in done:
            base = tmp_path_factory.mktemp(f"kinds-{backend}")
            want, specs = {}, []
            for kind in KINDS:
                run = str(base / kind)
                model, opt, extra = build(kind, seed=0)
                with dh.Checkpointer(run, backend=backend) as ckpt:
                    for s in range(WRITTEN):
                        train_step(model, opt, extra, s)
                    ckpt.write(WRITTEN - 1, model, opt, **extra)
                    losses = [train_step(model, opt, extra, s) for s in range(WRITTEN, WRITTEN + MORE)]
                want[kind] = outcome(model, opt, losses)
                specs.append(f"{run}:{kind}")
            out = str(base / "resumed.pt")
            proc = subprocess.run([sys.executable, HERE, "resume", out, *specs], capture_output=True, text=True,
                                  cwd=str(base), timeout=600)
            assert proc.returncode == 0, proc.stderr[-4000:]
            done[backend] = want, torch.load(out, weights_only=False)
        return done[backend]
    return get


@pytest.mark.parametrize("kind", KINDS)
def test_a_fresh_process_resumes_bit_exact(resumed, backend, kind):
    want, got = resumed(backend)
    assert differences(want[kind], got[kind]) == []
    if kind == "adafactor":  # factored moments: rows [8, 1] and columns [1, 6] of the [8, 6] weight
        state = got[kind]["optim"]["state"][0]
        assert state["row_var"].shape == (8, 1) and state["col_var"].shape == (1, 6)
    if kind == "lbfgs":  # its history: lists of tensors
        state = got[kind]["optim"]["state"][0]
        assert len(state["old_dirs"]) == 3 and all(isinstance(t, torch.Tensor) for t in state["old_dirs"])
    if kind == "adam_tensor_lr":  # still a tensor, scheduled
        lr = got[kind]["optim"]["param_groups"][0]["lr"]
        assert isinstance(lr, torch.Tensor) and lr.item() == pytest.approx(0.01 * 0.9 ** (WRITTEN + MORE))
    if kind == "adamw_tensor_betas":
        assert all(isinstance(b, torch.Tensor) for b in got[kind]["optim"]["param_groups"][0]["betas"])
    if kind == "int_keys":  # the count goes on: no key came back as a string
        state = got[kind]["optim"]["state"][0]
        assert list(state) == ["momentum_buffer", 0, 1, "note"] and state[0] == WRITTEN + MORE
        assert state["note"] == ("count", str(WRITTEN + MORE))


def test_tensor_hyper_parameters_and_state_lists_are_tensor_items(tmp_path, backend):
    """A tensor hyper-parameter is a tensor of the step, named by its group; a tensor in
    a list of the state is named by its key and index; the values hold placeholders."""
    run = str(tmp_path / "run")
    model, opt, extra = build("adamw_tensor_betas", seed=0)
    other, lbfgs, _ = build("lbfgs", seed=0)
    train_step(model, opt, extra, 0)
    for s in range(2):
        train_step(other, lbfgs, {}, s)
    with dh.Checkpointer(run, backend=backend) as ckpt:
        ckpt.write(0, model, opt)
        ckpt.write(1, other, lbfgs)
    with dh.open(run) as h:
        names = set(h.tensors(0)["name"])
        assert {"optim/param_groups/0/betas/0", "optim/param_groups/0/betas/1"} <= names
        assert torch.equal(h.read("optim/param_groups/0/betas/1", 0), torch.tensor(0.99))
        names = set(h.tensors(1)["name"])
        assert {"optim/state/0.weight/d", "optim/state/0.weight/old_dirs/0", "optim/state/0.weight/ro/0"} <= names
        assert torch.equal(h.read("optim/state/0.weight/old_dirs/0", 1), lbfgs.state[other[0].weight]["old_dirs"][0])
    store = Store(run)
    try:
        with store.open_step(0) as data:
            options = data.values["items"]["optim/param_groups"]["groups"][0]["options"]
        with store.open_step(1) as data:
            entry = data.values["items"]["optim/state"]["0.weight"]
    finally:
        store.close()
    assert options["betas"] == {"__tuple__": [{"__tensor__": "param_groups/0/betas/0"},
                                              {"__tensor__": "param_groups/0/betas/1"}]}
    assert entry["old_dirs"][0] == {"__tensor__": "state/0.weight/old_dirs/0"} and "d" not in entry


def test_state_keys_that_cannot_be_told_apart_or_stored_are_refused_at_write(run_dir):
    model, opt, extra = build("int_keys", seed=0)
    train_step(model, opt, extra, 0)
    weight = model[0].weight
    opt.state[weight]["1"] = torch.zeros(2)  # int key 1 holds a tensor too
    with dh.Checkpointer(run_dir) as ckpt:
        with pytest.raises(ValueError, match=r"cannot checkpoint 'optim': CountingSGD state '1' of parameter "
                                             r"'0\.weight': its tensor would be stored as state/0\.weight/1, which "
                                             r"another state of the optimizer is stored as"):
            ckpt.write(0, model, opt)
        del opt.state[weight]["1"]
        opt.state[weight][object] = 1  # a key no value can hold
        with pytest.raises(TypeError, match=r"cannot checkpoint 'optim': CountingSGD state <class 'object'> of "
                                            r"parameter '0\.weight': a state key of type builtins\.type cannot be "
                                            r"stored; a key may be a string, int, float, bool, None or a tuple"):
            ckpt.write(0, model, opt)
        del opt.state[weight][object]
        ckpt.write(0, model, opt)
    with dh.open(run_dir) as h:
        assert h.steps == [0]


# --- strict restores still refuse what does not fit -------------------------------------

def test_a_live_state_of_another_shape_is_named_and_nothing_changes(run_dir, backend):
    model, opt, extra = build("history", seed=0)
    for s in range(2):
        train_step(model, opt, extra, s)
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        ckpt.write(1, model, opt)
    target, target_opt, _ = build("history", seed=1)
    target_opt.param_groups[0]["depth"] = 3  # its own state (after a step) is [3, numel]
    train_step(target, target_opt, {}, 7)
    before, weights = copy.deepcopy(target_opt.state_dict()), copy.deepcopy(target.state_dict())
    with dh.Checkpointer(run_dir) as ckpt:
        with pytest.raises(dh.RestoreMismatchError) as err:
            ckpt.restore(1, target, target_opt)
    assert err.value.mismatched == [
        (f"optim/state/{n}/past", f"shape [3, {p.numel()}]", f"shape [2, {p.numel()}]")
        for n, p in target.named_parameters()]
    assert "  optim/state/0.weight/past: expected shape [3, 48], found shape [2, 48]\n" in str(err.value)
    assert differences(before, target_opt.state_dict()) == [] and differences(weights, target.state_dict()) == []
    with dh.Checkpointer(run_dir) as ckpt:  # strict=False: each parameter keeps its own state
        r = ckpt.restore(1, target, target_opt, strict=False)
    assert [n for n, _, _ in r.problems.mismatched] == [n for n, _, _ in err.value.mismatched]
    assert differences(before["state"], target_opt.state_dict()["state"]) == []
    assert differences(model.state_dict(), target.state_dict()) == []


def test_a_fresh_stock_optimizer_refuses_the_state_of_a_reshaped_parameter(run_dir, backend):
    """Adam's state is of its parameter's shape: with none of its own to compare with, the
    parameter's shape decides (a reshaped layer's moments would not step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def train_step_4(m, o):
        o.zero_grad()
        m(torch.randn(5, 4)).square().mean().backward()
        o.step()

    train_step_4(model, opt)
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        ckpt.write(0, model, opt)
    target = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 5))
    target_opt = torch.optim.Adam(target.parameters(), lr=0.01)
    with dh.Checkpointer(run_dir) as ckpt:
        with pytest.raises(dh.RestoreMismatchError) as err:
            ckpt.restore(0, target, target_opt)
        assert ("optim/state/1.weight/exp_avg", "shape [5, 3]", "shape [2, 3]") in err.value.mismatched
        r = ckpt.restore(0, target, target_opt, strict=False)
    assert sorted(n for n, _, _ in r.problems.mismatched if n.startswith("optim/")) == [
        "optim/state/1.bias/exp_avg", "optim/state/1.bias/exp_avg_sq",
        "optim/state/1.weight/exp_avg", "optim/state/1.weight/exp_avg_sq"]
    assert target[1].weight not in target_opt.state and target[0].weight in target_opt.state
    train_step_4(target, target_opt)  # it steps on


# --- the state of sharded parameters, across a change of the number of ranks ----------------

def sharded_model(mesh):
    """Two bias-free layers, their weights sharded by rows over ``mesh`` (None: plain)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.Tanh(), nn.Linear(6, 2, bias=False))
    if mesh is not None:
        from torch.distributed.tensor import Shard, distribute_tensor

        for layer in (model[0], model[2]):
            layer.weight = nn.Parameter(distribute_tensor(layer.weight.data, mesh, [Shard(0)]))
    return model


def sharded_step(model, opt, mesh, step):
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
    if mesh is not None:
        from torch.distributed.tensor import DTensor, Replicate

        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def whole(t):
    return t.full_tensor() if type(t).__name__ == "DTensor" else t


def sharded_write(run: str, backend: str) -> None:
    """Under torchrun: 2 ranks train RowScaled on row-sharded weights and write step 1;
    rank 0 keeps the global tensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = sharded_model(mesh)
    opt = RowScaled(model.parameters())
    with dh.Checkpointer(run, comm="torch", backend=backend) as ckpt:
        for s in range(2):
            sharded_step(model, opt, mesh, s)
        ckpt.write(1, model, opt)
    want = {f"{n}/{k}": whole(v) for n, p in model.named_parameters() for k, v in opt.state[p].items()}
    want.update({n: whole(p.detach()) for n, p in model.named_parameters()})
    if dist.get_rank() == 0:
        torch.save(want, run + ".want.pt")
    dist.destroy_process_group()


def sharded_restore(run: str) -> None:
    """In one process: restore the 2 ranks' step plain, sharded over 1 rank into a fresh
    optimizer (refused), and sharded into one that has stepped; then LBFGS over sharded
    weights into a fresh one (refused); print what each gave."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    dist.init_process_group("gloo", init_method=f"file://{run}.pg", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    want = torch.load(run + ".want.pt")

    def got(model, opt):
        out = {f"{n}/{k}": whole(v) for n, p in model.named_parameters() for k, v in opt.state[p].items()}
        out.update({n: whole(p.detach()) for n, p in model.named_parameters()})
        return {"equal": sorted(out) == sorted(want) and all(same_bits(out[n], want[n]) for n in want),
                "sharded": sorted(f"{n}/{k}" for n, p in model.named_parameters() for k, v in opt.state[p].items()
                                  if type(v).__name__ == "DTensor")}

    report = {}
    plain = sharded_model(None)
    plain_opt = RowScaled(plain.parameters())
    with dh.Checkpointer(run) as ckpt:
        ckpt.restore(1, plain, plain_opt)
    report["plain"] = got(plain, plain_opt)
    fresh = sharded_model(mesh)
    fresh_opt = RowScaled(fresh.parameters())
    with dh.Checkpointer(run) as ckpt:
        try:
            ckpt.restore(1, fresh, fresh_opt)
            report["fresh"] = "restored"
        except dh.RestoreMismatchError as exc:
            report["fresh"] = exc.mismatched
    stepped = sharded_model(mesh)
    stepped_opt = RowScaled(stepped.parameters())
    sharded_step(stepped, stepped_opt, mesh, 9)
    with dh.Checkpointer(run) as ckpt:
        ckpt.restore(1, stepped, stepped_opt)
    report["stepped"] = got(stepped, stepped_opt)
    lbfgs_run = run + ".lbfgs"  # LBFGS over the sharded weights: its history lists tensors of both
    model = sharded_model(mesh)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=3, history_size=2)
    x = DTensor.from_local(torch.randn(5, 4), mesh, [Replicate()], run_check=False)

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    opt.step(closure)
    with dh.Checkpointer(lbfgs_run) as ckpt:
        ckpt.write(0, model, opt)
    fresh = sharded_model(mesh)
    with dh.Checkpointer(lbfgs_run) as ckpt:
        try:
            ckpt.restore(0, fresh, torch.optim.LBFGS(fresh.parameters(), max_iter=3, history_size=2))
            report["lbfgs"] = "restored"
        except dh.RestoreMismatchError as exc:
            report["lbfgs"] = exc.mismatched
    print(json.dumps(report))
    dist.destroy_process_group()


def test_sharded_state_of_another_shape_reshards_only_as_the_optimizers_own(tmp_path):
    """2 ranks write; 1 restores. The momentum (the weight's shape) is sharded like the
    weight; ``rows`` ([n, 1]) is read whole into a plain optimizer, sharded like the
    optimizer's own where it has it, and refused where it has none: nothing to reshard by."""
    run = str(tmp_path / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           HERE, "sharded-write", run, "adios2"], capture_output=True, text=True, env=env,
                          cwd=str(tmp_path), timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    proc = subprocess.run([sys.executable, HERE, "sharded-restore", run], capture_output=True, text=True, env=env,
                          cwd=str(tmp_path), timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["plain"] == {"equal": True, "sharded": []}
    reason = ("the parameter is sharded: a state tensor of another shape is laid out as the optimizer's own, and "
              "it holds none to reshard it by")
    assert report["fresh"] == [["optim/state/0.weight/rows", f"shape [6, 4] or [] ({reason})", "shape [6, 1]"],
                               ["optim/state/2.weight/rows", f"shape [2, 6] or [] ({reason})", "shape [2, 1]"]]
    assert report["stepped"] == {"equal": True, "sharded": ["0.weight/m", "0.weight/rows", "2.weight/m",
                                                            "2.weight/rows"]}
    # LBFGS over sharded weights, into a fresh one: its flat vectors and its history lists are refused
    listed = "no tensors in a list or dict (the parameter is sharded: they cannot be resharded)"
    assert report["lbfgs"] == [
        *([f"optim/state/0.weight/{key}", listed, "1 tensor in a list or dict"]
          for key in ("al", "old_dirs", "old_stps", "ro")),
        *([f"optim/state/0.weight/{key}", f"shape [6, 4] or [] ({reason})", "shape [36]"]
          for key in ("d", "prev_flat_grad"))]


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "resume":
        resume(args[0], args[1:])
    elif command == "sharded-write":
        sharded_write(*args)
    elif command == "sharded-restore":
        sharded_restore(*args)
    else:
        raise SystemExit(f"unknown command {command}")


def test_an_optimizer_extra_not_passed_to_restore_is_rebuilt_with_its_tensors(run_dir, backend):
    """An LBFGS (lists of tensors in its state) and an Adam with a tensor lr written as
    extras, restored without them: each comes back as its items, the tensors inside its
    values read (not a placeholder the restore cannot resolve)."""
    model, other = nn.Linear(2, 2), nn.Linear(3, 3)
    lbfgs = torch.optim.LBFGS(other.parameters(), history_size=3)
    adam = torch.optim.Adam(other.parameters(), lr=torch.tensor(0.01))

    def closure():
        lbfgs.zero_grad()
        loss = other(torch.ones(1, 3)).pow(2).sum()
        loss.backward()
        return loss

    for _ in range(2):
        lbfgs.step(closure)
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        ckpt.write(0, model, lbfgs_opt=lbfgs, adam_opt=adam)
        restored = ckpt.restore(0, model)
    rebuilt = restored.extra["lbfgs_opt"]
    entry = next(iter(lbfgs.state.values()))
    state = next(v for k, v in rebuilt["state"].items())
    assert len(state["old_dirs"]) == len(entry["old_dirs"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(state["old_dirs"], entry["old_dirs"]))
    lr = restored.extra["adam_opt"]["param_groups"]["groups"][0]["options"]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.item() == pytest.approx(0.01)
