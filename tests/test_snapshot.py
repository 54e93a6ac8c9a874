"""The lazy snapshot captures exactly the state at write() time, whatever runs next."""

import random

import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist.store import Store


def stored(run_dir, step, name):
    store = Store(run_dir)
    with store.open_step(step) as data:
        t = data.read(name)
    store.close()
    return t


def test_optimizer_step_right_after_write_does_not_leak_into_the_snapshot(run_dir, backend):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512), torch.nn.Linear(512, 8))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    # a cache far smaller than the state: the snapshot is still running when training goes on
    ckpt = dh.Checkpointer(run_dir, backend=backend, host_cache_bytes=128 << 10, piece_bytes=32 << 10)
    expected = {}
    for step in range(4):
        model(torch.randn(16, 512)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        expected[step] = ({k: v.detach().clone() for k, v in model.state_dict().items()},
                          opt.state[model[0].weight]["exp_avg"].clone())
        ckpt.write(step, model, opt)
        # the next forward changes BatchNorm statistics, the next step changes everything
    ckpt.close()
    for step, (state, exp_avg) in expected.items():
        for name, value in state.items():
            assert torch.equal(stored(run_dir, step, f"model/{name}"), value), (step, name)
        assert torch.equal(stored(run_dir, step, "optim/state/0.weight/exp_avg"), exp_avg)


def test_rng_restore_continues_the_same_random_streams(run_dir):
    model = torch.nn.Linear(2, 2)
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(0, model)
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.restore(model=model)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]
    torch.manual_seed(9)
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.restore(model=model, rng=False)
    assert not torch.equal(torch.rand(3), want[0])


class Counter:
    """A user type with no state_dict(), checkpointed through a registered provider."""

    def __init__(self, counts):
        self.counts = torch.as_tensor(counts)
        self.label = "c"


class CounterProvider(dh.StateProvider):
    def items(self, obj, ctx):
        yield dh.TensorItem("counts", obj.counts, volatile=True)
        yield dh.ValueItem("label", obj.label)

    def load(self, obj, state, ctx):
        obj.counts.copy_(state.tensor("counts"))
        obj.label = state.values["label"]
        return obj


def test_user_registered_provider(run_dir):
    dh.register_provider(Counter, CounterProvider())
    model = torch.nn.Linear(2, 2)
    with dh.Checkpointer(run_dir) as ckpt:
        c = Counter([1, 2, 3])
        c.label = "saved"
        ckpt.write(0, model, counter=c)
    target = Counter([0, 0, 0])
    with dh.Checkpointer(run_dir) as ckpt:
        r = ckpt.restore(model=model, counter=target)
    assert r.extra["counter"] is target
    assert target.counts.tolist() == [1, 2, 3] and target.label == "saved"
    with dh.Checkpointer(run_dir) as ckpt:  # not passed: its items come back by name
        items = ckpt.restore(model=model).extra["counter"]
    assert items["label"] == "saved" and items["counts"].tolist() == [1, 2, 3]


def test_bound_objects_and_state_dict_extras(run_dir):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with dh.Checkpointer(run_dir, model=model, optimizer=opt) as ckpt:
        for step in range(5):
            model(torch.randn(2, 3)).sum().backward()
            opt.step(), sched.step(), opt.zero_grad()
            ckpt.write(step, scheduler=sched, data={"epoch": 1, "batch": step})
    model2 = torch.nn.Linear(3, 3)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.5, momentum=0.9)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    with dh.Checkpointer(run_dir, model=model2, optimizer=opt2) as ckpt:
        r = ckpt.restore(scheduler=sched2)
    assert r.step == 4 and r.extra["data"] == {"epoch": 1, "batch": 4}
    assert sched2.state_dict() == sched.state_dict()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert torch.equal(opt2.state[model2.weight]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"])
    assert torch.equal(model2.weight, model.weight)


class Sharded:
    def __init__(self, part, offset):
        self.part, self.offset = part, offset


class ShardProvider(dh.StateProvider):
    def items(self, obj, ctx):
        yield dh.TensorItem("w", obj.part, global_shape=(8, 4), offset=obj.offset)

    def load(self, obj, state, ctx):
        obj.part.copy_(state.tensor("w"))
        return obj


def test_shards_record_their_place_in_the_global_tensor(run_dir):
    dh.register_provider(Sharded, ShardProvider())
    model = torch.nn.Linear(2, 2)
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(0, model, shard=Sharded(torch.ones(4, 4), (4, 0)))
        with pytest.raises(ValueError, match=r"shard 'extra/shard/w' of shape \[4, 4\] at offset \[6, 0\] does not fit"):
            ckpt.write(1, model, shard=Sharded(torch.ones(4, 4), (6, 0)))
    store = Store(run_dir)
    with store.open_step(0) as data:
        rec = data.records["extra/shard/w"]
    store.close()
    assert rec.global_shape == (8, 4) and rec.offset == (4, 0) and rec.shape == (4, 4)


def test_a_second_model_and_optimizer_given_as_extras_are_guarded_too(run_dir, backend):
    """A GAN: the discriminator and its optimizer are extras, and the next iteration
    steps them before the generator's forward."""
    torch.manual_seed(0)
    generator, discriminator = torch.nn.Linear(64, 64), torch.nn.Linear(512, 512)
    opt_g = torch.optim.SGD(generator.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=0.1, momentum=0.9)
    ckpt = dh.Checkpointer(run_dir, backend=backend, host_cache_bytes=128 << 10, piece_bytes=32 << 10)
    expected = {}
    for step in range(3):
        opt_d.zero_grad()
        discriminator(torch.randn(8, 512)).pow(2).mean().backward()
        opt_d.step()
        opt_g.zero_grad()
        generator(torch.randn(8, 64)).pow(2).mean().backward()
        opt_g.step()
        expected[step] = (discriminator.weight.detach().clone(),
                          opt_d.state[discriminator.weight]["momentum_buffer"].clone())
        ckpt.write(step, generator, opt_g, D=discriminator, opt_D=opt_d)
    ckpt.close()
    with dh.open(run_dir) as h:
        names = h.names(0)
    momentum = [n for n in names if n.startswith("extra/opt_D/state/") and n.endswith("/momentum_buffer")
                and stored(run_dir, 0, n).shape == (512, 512)]
    assert len(momentum) == 1, names
    for step, (weight, momentum_buffer) in expected.items():
        assert torch.equal(stored(run_dir, step, "extra/D/weight"), weight), step
        assert torch.equal(stored(run_dir, step, momentum[0]), momentum_buffer), step

