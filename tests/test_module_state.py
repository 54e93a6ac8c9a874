"""A module's state is what its ``state_dict()`` holds, not only its parameters and
buffers: a submodule's extra state (``get_extra_state()``: a dict of values and tensors,
or a tensor) and the tensors a state-dict hook makes come back through the module's own
``load_state_dict()``. They were stored and then left unloaded (or, for an extra state
that is not a tensor, never stored), with no problem reported. What ``state_dict()``
holds that cannot be stored is refused at ``write()``."""

import pytest
import torch
from torch import nn

import datastates_hist as dh


class Calibrated(nn.Module):
    """A module with extra state: a counter and a calibration tensor."""

    def __init__(self, counter=0, calib=None):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.counter, self.calib = counter, torch.zeros(3) if calib is None else calib

    def get_extra_state(self):
        return {"counter": self.counter, "calib": self.calib.clone(), "name": "run-1"}

    def set_extra_state(self, state):
        self.counter, self.calib, self.name = state["counter"], state["calib"].clone(), state["name"]


class TensorState(Calibrated):
    def get_extra_state(self):
        return self.calib.clone()

    def set_extra_state(self, state):
        self.calib = state.clone()


class Scaled(nn.Module):
    """Stores its weight doubled under another name; a load pre-hook undoes it."""

    def __init__(self, undo=True):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self._register_state_dict_hook(lambda mod, sd, prefix, meta: sd.__setitem__(
            prefix + "W", sd.pop(prefix + "lin.weight") * 2))
        if undo:
            def pre(sd, prefix, *rest):
                if prefix + "W" in sd:
                    sd[prefix + "lin.weight"] = sd.pop(prefix + "W") / 2
            self._register_load_state_dict_pre_hook(pre)


def written(tmp_path, backend, model, **extra):
    run = str(tmp_path / "run")
    with dh.Checkpointer(run, backend=backend) as ckpt:
        ckpt.write(0, model, **extra)
    return run


def test_an_extra_state_of_values_and_tensors_comes_back(tmp_path, backend):
    torch.manual_seed(0)
    model = nn.Sequential(Calibrated(7, torch.tensor([1.0, 2.0, float("nan")])), nn.Linear(2, 1))
    run = written(tmp_path, backend, model, other=Calibrated(3, torch.ones(3)))
    with dh.open(run) as h:
        assert "model/0._extra_state/calib" in h.names(0)
    fresh = nn.Sequential(Calibrated(), nn.Linear(2, 1))
    with dh.Checkpointer(run) as ckpt:
        restored = ckpt.restore(0, model=fresh)
        other = ckpt.restore(0, model=nn.Sequential(Calibrated(), nn.Linear(2, 1)), other=Calibrated()).extra["other"]
    assert not restored.problems
    assert (fresh[0].counter, fresh[0].name) == (7, "run-1")
    assert torch.equal(fresh[0].calib.view(torch.int32), torch.tensor([1.0, 2.0, float("nan")]).view(torch.int32))
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
    assert (other.counter, other.calib.tolist()) == (3, [1.0, 1.0, 1.0])


def test_an_extra_state_that_is_a_tensor_goes_to_set_extra_state(tmp_path, backend):
    run = written(tmp_path, backend, TensorState(calib=torch.tensor([4.0, 5.0, 6.0])))
    fresh = TensorState()
    with dh.Checkpointer(run) as ckpt:
        ckpt.restore(0, model=fresh)
    assert fresh.calib.tolist() == [4.0, 5.0, 6.0]


def test_a_strict_restore_names_an_extra_state_the_module_lacks_or_the_step_lacks(tmp_path):
    run = written(tmp_path, "adios2", Calibrated(7))
    plain = nn.Module()
    plain.lin = nn.Linear(2, 2)
    with dh.Checkpointer(run) as ckpt:
        with pytest.raises(dh.RestoreMismatchError) as exc:
            ckpt.restore(0, model=plain)
    assert sorted(exc.value.unexpected) == ["model/_extra_state", "model/_extra_state/calib"]
    run = written(tmp_path / "b", "adios2", plain)
    with dh.Checkpointer(run) as ckpt:
        with pytest.raises(dh.RestoreMismatchError) as exc:
            ckpt.restore(0, model=Calibrated())
    assert sorted(exc.value.missing) == ["model/_extra_state", "model/_extra_state/calib"]


def test_tensors_a_state_dict_hook_makes_go_back_through_its_load_hook(tmp_path, backend):
    torch.manual_seed(0)
    model = Scaled()
    run = written(tmp_path, backend, model)
    with dh.open(run) as h:
        assert h.names(0) == ["model/W", "model/lin.bias", "rng/torch"]
    fresh = Scaled()
    with dh.Checkpointer(run) as ckpt:
        ckpt.restore(0, model=fresh)
    assert torch.equal(fresh.lin.weight, model.lin.weight) and torch.equal(fresh.lin.bias, model.lin.bias)


def test_a_tensor_a_state_dict_hook_makes_and_no_load_hook_takes_is_not_loaded_in_silence(tmp_path):
    run = written(tmp_path, "hdf5", Scaled(undo=False))
    with dh.Checkpointer(run) as ckpt:
        with pytest.raises(RuntimeError) as exc:
            ckpt.restore(0, model=Scaled(undo=False))
    assert str(exc.value) == ("the module's load_state_dict() does not take 'W', which its state_dict() gives "
                              "(a state_dict hook without a load hook?): not loaded")


def test_what_a_state_dict_holds_that_cannot_be_stored_is_refused_at_write(tmp_path):
    class Typed(nn.Module):
        def get_extra_state(self):
            return {"dtype": torch.float16}

        def set_extra_state(self, state):
            pass

    run = str(tmp_path / "run")
    with dh.Checkpointer(run) as ckpt:
        with pytest.raises(TypeError) as exc:
            ckpt.write(0, nn.Sequential(Typed()))
        assert ckpt.steps() == []
    assert str(exc.value) == (
        "cannot checkpoint 'model': module state '0._extra_state'/dtype: a value of type torch.dtype cannot be "
        "stored without pickle; convert it to numbers, strings, lists and dicts, give it "
        "state_dict()/load_state_dict(), or register a StateProvider for its type")


def test_an_expanded_tensor_to_load_into_is_a_named_mismatch(tmp_path, backend):
    """copy_() into a stride-0 tensor fails: restore failed inside torch, after loading
    other tensors."""
    def build(seed):
        torch.manual_seed(seed)
        model = nn.Linear(2, 2)
        model.register_buffer("ex", torch.arange(4.0).reshape(4, 1).expand(4, 5))
        return model
    run = written(tmp_path, backend, build(0), xe=torch.arange(3.0).expand(2, 3))
    model, before = build(1), build(1).weight.detach().clone()
    found = "an expanded tensor whose elements share memory: clone() it first"
    with dh.Checkpointer(run) as ckpt:
        with pytest.raises(dh.RestoreMismatchError) as exc:
            ckpt.restore(0, model=model, xe=torch.zeros(3).expand(2, 3))
        assert exc.value.mismatched == [("model/ex", "a tensor to load into", found),
                                        ("extra/xe", "a tensor to load into", found)]
        assert torch.equal(model.weight, before)
        partial = ckpt.restore(0, model=model, xe=torch.zeros(3).expand(2, 3), strict=False)
    assert torch.equal(model.weight, build(0).weight) and partial.skipped == ["extra/xe"]
    assert [name for name, *_ in partial.problems.mismatched] == ["model/ex", "extra/xe"]


def test_a_lazy_module_not_yet_run_is_refused_by_name(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2), nn.LazyLinear(3))
    says = "'1.weight' of a lazy module (nn.LazyLinear, ...) has no shape yet: run a forward pass first"
    run = str(tmp_path / "run")
    with dh.Checkpointer(run) as ckpt:
        with pytest.raises(ValueError) as exc:
            ckpt.write(0, model)
        assert str(exc.value) == says
        model(torch.ones(1, 2))
        ckpt.write(1, model)
        with pytest.raises(ValueError) as exc:
            ckpt.restore(1, model=nn.Sequential(nn.Linear(2, 2), nn.LazyLinear(3)))
        assert str(exc.value) == says
    assert dh.open(run).steps == [1]
