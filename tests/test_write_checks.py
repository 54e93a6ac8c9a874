"""``write()`` refuses what the index or the backends cannot hold, before anything is queued.

Each refusal names the step or the item, with the exact message checked here;
after it nothing is committed, no step unit is left in ``steps/``, and the
next good write goes on as if the bad one had not happened.
"""

import os

import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist.layout import MAX_STEP

NAME_RULE = "which the backends cannot store; use keys that are not empty, '.' or '..'"


def linear():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def refused(run_dir, step=0, **extra):
    """The error of ``write(step, **extra)``; checks that nothing was written, and that
    the Checkpointer still writes step 0 afterwards."""
    with dh.Checkpointer(run_dir) as ckpt:
        with pytest.raises(Exception) as info:
            ckpt.write(step, linear(), **extra)
        ckpt.wait()
        assert ckpt.steps() == []
        assert os.listdir(os.path.join(run_dir, "steps")) == []
        ckpt.write(0, linear())
        ckpt.wait()
        assert ckpt.steps() == [0]
    return info


# --- steps -----------------------------------------------------------------------------

@pytest.mark.parametrize("step", [2**63, 2**64 + 5])
def test_step_beyond_the_index_range_is_refused(run_dir, step):
    info = refused(run_dir, step)
    assert info.type is ValueError
    assert str(info.value) == (f"step {step} is too large: steps go up to 2**63-1 = {MAX_STEP} "
                               "(a signed 64-bit integer, as the index stores them)")


def test_largest_step_commits_and_restores(run_dir, backend):
    model = linear()
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        ckpt.write(MAX_STEP, model)
        ckpt.wait()
        assert ckpt.steps() == [MAX_STEP]
        fresh = torch.nn.Linear(4, 3)
        assert ckpt.restore(np.int64(MAX_STEP), model=fresh).step == MAX_STEP
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert [n.split(".")[0] for n in os.listdir(os.path.join(run_dir, "steps"))] == [str(MAX_STEP)]


def test_restore_beyond_the_index_range_is_a_missing_step(run_dir):
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(0, linear())
        with pytest.raises(dh.StepNotFoundError) as info:
            ckpt.restore(2**63, model=linear())
    assert str(info.value) == f"step {2**63} is not committed in {run_dir}: steps go up to 2**63-1 = {MAX_STEP}"


def test_numpy_integers_are_steps_for_write_restore_and_truncate(run_dir):
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(np.int64(3), linear())
        ckpt.write(np.uint16(5), linear())
        ckpt.write(np.int32(7), linear())
        ckpt.wait()
        assert ckpt.steps() == [3, 5, 7] and all(type(s) is int for s in ckpt.steps())
        assert ckpt.restore(np.int64(5), model=linear()).step == 5
        assert ckpt.truncate(after=np.int8(4)) == [5, 7]
        ckpt.write(np.int64(4), linear())  # after the truncation, 4 follows 3
        ckpt.wait()
        assert ckpt.steps() == [3, 4]


@pytest.mark.parametrize("step, message", [
    (True, "step must be a non-negative int, got True"),
    (np.bool_(True), "step must be a non-negative int, got np.True_"),
    (np.float64(2.0), "step must be a non-negative int, got np.float64(2.0)"),
    (np.int64(-2), "step must be a non-negative int, got -2"),
])
def test_steps_that_are_not_whole_numbers(run_dir, step, message):
    info = refused(run_dir, step)
    assert info.type is ValueError and str(info.value) == message


def test_restore_refuses_a_bool_like_write(run_dir):
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(1, linear())
        with pytest.raises(TypeError) as info:
            ckpt.restore(True, model=linear())
    assert str(info.value) == "restore() needs a step number (int) or None for the newest, got True"


# --- names -----------------------------------------------------------------------------

T = torch.ones(2)

NAME_CASES = [
    ("an empty extra key", {"": T}, f"extra 'extra/' has an empty name component (between '/'), {NAME_RULE}"),
    ("an extra key '.'", {".": T}, f"extra 'extra/.' has a '.' name component (between '/'), {NAME_RULE}"),
    ("an extra key '..'", {"..": 3}, f"extra 'extra/..' has a '..' name component (between '/'), {NAME_RULE}"),
    ("a doubled slash", {"a//b": T}, f"extra 'extra/a//b' has an empty name component (between '/'), {NAME_RULE}"),
    ("a trailing slash", {"a/": T}, f"extra 'extra/a/' has an empty name component (between '/'), {NAME_RULE}"),
    ("a NUL in an extra key", {"a\0b": T},
     "extra 'extra/a\\x00b' holds a NUL character, which ends a name in the backends"),
    ("a lone surrogate", {"a\udc80": T}, "extra 'extra/a\\udc80' is not valid Unicode (it holds a lone surrogate)"),
    ("a key '.' inside a dict", {"d": {"a": {".": T}}},
     f"tensor 'extra/d/a/.' has a '.' name component (between '/'), {NAME_RULE}"),
    ("an empty key inside a dict", {"d": {"a": {"": T}}},
     f"tensor 'extra/d/a/' has an empty name component (between '/'), {NAME_RULE}"),
    ("x beside x/y", {"x": T, "x/y": T},
     "tensor 'extra/x' is also the group of tensor 'extra/x/y': a name cannot be both a tensor and the "
     "prefix of another; rename one"),
    ("x beside x/y/z", {"x": T, "x/y": {"z": T}},
     "tensor 'extra/x' is also the group of tensor 'extra/x/y/z': a name cannot be both a tensor and the "
     "prefix of another; rename one"),
    ("one tensor named twice", {"x": {"y": T}, "x/y": T}, "two tensors are named 'extra/x/y'; rename one"),
    ("one value named twice", {"opt": torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), "opt/state": 1},
     "two values are named 'extra/opt/state'; rename one"),
    ("restore()'s strict", {"strict": 1},
     "an extra cannot be named 'strict': restore() takes strict= as its own option; rename it"),
    ("restore()'s rng", {"rng": {"seed": 1}},
     "an extra cannot be named 'rng': restore() takes rng= as its own option (whether to restore RNG states; "
     "write() always captures them); rename it"),
]


@pytest.mark.parametrize("extra, message", [c[1:] for c in NAME_CASES], ids=[c[0] for c in NAME_CASES])
def test_names_the_backends_cannot_hold_are_refused(run_dir, extra, message):
    info = refused(run_dir, **extra)
    assert info.type is ValueError and str(info.value) == message


def test_control_characters_other_than_nul_are_stored(run_dir, backend):
    """HDF5 and ADIOS2 both keep them (measured); only NUL ends a name there."""
    names = {"tab\there": torch.arange(3.0), "line\nbreak": torch.arange(4.0), "esc\x1b[0m": torch.ones(1)}
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        ckpt.write(0, linear(), **names)
        ckpt.wait()
    with dh.open(run_dir) as h:
        for key, tensor in names.items():
            assert torch.equal(h.read(f"extra/{key}", 0), tensor)


# --- nesting ---------------------------------------------------------------------------

def nested(depth):
    outer = inner = []
    for _ in range(depth - 1):
        inner.append([])
        inner = inner[0]
    inner.append(torch.arange(2))
    return outer


class LoopingState:
    """An object whose state_dict holds itself."""

    def state_dict(self):
        state = {"epoch": 2, "history": []}
        state["history"].append(state)
        return state

    def load_state_dict(self, state):
        pass


def self_holding_list():
    loop = [1, 2]
    loop.append({"back": loop})
    return loop


NESTING_CASES = [
    ("nested 500 deep", lambda: {"deep": nested(500)},
     "cannot checkpoint 'extra/deep': value" + "/0" * 27 + "/... "
     "is nested more than 100 levels deep (lists, tuples and dicts inside each other)"),
    ("a list holding itself", lambda: {"loop": self_holding_list()},
     "cannot checkpoint 'extra/loop': value/2/back contains itself (a list, tuple or dict that holds itself)"),
    ("a state_dict holding itself", lambda: {"sampler": LoopingState()},
     "cannot checkpoint 'extra/sampler': LoopingState/history/0 contains itself "
     "(a list, tuple or dict that holds itself)"),
]


@pytest.mark.parametrize("make, message", [c[1:] for c in NESTING_CASES], ids=[c[0] for c in NESTING_CASES])
def test_deep_or_self_holding_values_are_refused(run_dir, make, message):
    info = refused(run_dir, **make())
    assert info.type is ValueError and str(info.value) == message


def test_nesting_up_to_the_limit_round_trips(run_dir):
    value = nested(100)
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(0, linear(), deep=value)
        restored = ckpt.restore(model=linear()).extra["deep"]
    for _ in range(99):
        assert isinstance(restored, list) and len(restored) == 1
        restored = restored[0]
    assert len(restored) == 1 and torch.equal(restored[0], torch.arange(2))
    info = refused(run_dir + "2", deep=nested(101))
    assert "is nested more than 100 levels deep" in str(info.value)


# --- numpy arrays ----------------------------------------------------------------------

ARRAY_CASES = [
    ("strings", np.array(["a", "bc"]), "strings (dtype <U2)"),
    ("byte strings", np.array([b"a"]), "byte strings (dtype |S1)"),
    ("dates", np.array(["2020-01-01"], dtype="datetime64[D]"), "dates (dtype datetime64[D])"),
    ("durations", np.array([5], dtype="timedelta64[s]"), "time durations (dtype timedelta64[s])"),
    ("records", np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]),
     "structured records (dtype [('a', '<i4'), ('b', '<f8')])"),
]


@pytest.mark.parametrize("array, kind", [c[1:] for c in ARRAY_CASES], ids=[c[0] for c in ARRAY_CASES])
def test_arrays_of_non_numbers_are_refused_with_their_name(run_dir, array, kind):
    info = refused(run_dir, batch={"meta": {"labels": array}})
    assert info.type is TypeError
    assert str(info.value) == (f"cannot checkpoint 'extra/batch': value/meta/labels: a numpy array of {kind} "
                               "cannot be stored; only arrays of numbers and booleans can (convert it, e.g. to a list)")


def test_array_of_a_dtype_torch_lacks_is_refused_with_its_name(run_dir):
    info = refused(run_dir, wide=np.zeros(3, dtype=np.longdouble))
    assert info.type is TypeError
    assert str(info.value) == ("cannot checkpoint 'extra/wide': value: a numpy array of dtype float128 cannot be "
                               "stored (torch has no such dtype)")


def test_an_empty_tensor_no_array_can_shape_is_refused(run_dir):
    """torch makes a 0-element tensor of any shape; numpy refuses one whose nonzero
    dimensions span more than 2**63-1 bytes, so no read could ever give it back."""
    info = refused(run_dir, e=torch.zeros(0, 2 ** 62))
    assert info.type is ValueError
    assert str(info.value) == ("tensor 'extra/e' cannot be stored: it has the shape [0, 4611686018427387904] of "
                               "4-byte elements: its nonzero dimensions span more than 2**63-1 bytes, more than "
                               "an array can address")


def test_empty_tensors_round_trip_with_their_shapes(run_dir, backend):
    model = linear()
    model.register_buffer("wide", torch.zeros(0, 2 ** 60))  # 2**62 bytes in its nonzero dimension: the most
    model.register_buffer("tall", torch.zeros(3, 0, dtype=torch.bfloat16))
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        ckpt.write(0, model)
        ckpt.write(1, model)
        fresh = linear()
        fresh.register_buffer("wide", torch.ones(0, 2 ** 60))
        fresh.register_buffer("tall", torch.ones(3, 0, dtype=torch.bfloat16))
        assert ckpt.restore(model=fresh).step == 1
    with dh.open(run_dir) as h:
        for step in (0, 1):
            assert h.read("wide", step=step).shape == (0, 2 ** 60)
            tall = h.read("tall", step=step)
            assert (tall.shape, tall.dtype) == ((3, 0), torch.bfloat16)


def test_big_endian_arrays_are_stored_value_exact(run_dir, backend):
    arrays = {"f8": np.linspace(-3, 7, 11).astype(">f8"), "i4": np.array([-5, 1, 2**31 - 1], dtype=">i4"),
              "c8": np.array([1 + 2j, -0.5j], dtype=">c8"), "u2": np.array([1, 65535], dtype=">u2")}
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        ckpt.write(0, linear(), arrays=arrays)
        restored = ckpt.restore(model=linear()).extra["arrays"]
    for key, array in arrays.items():
        got = restored[key]
        assert got.dtype == array.dtype.newbyteorder("=") and got.dtype.isnative
        assert np.array_equal(got, array) and got.tobytes() == array.astype(got.dtype).tobytes()


def test_an_error_of_an_extras_own_state_dict_says_whose_it_is(run_dir):
    class Broken:
        def state_dict(self):
            raise KeyError("weights")

        def load_state_dict(self, state):
            pass

    with dh.Checkpointer(run_dir) as ckpt:
        with pytest.raises(KeyError) as caught:
            ckpt.write(0, torch.nn.Linear(2, 2), sampler=Broken())
        assert caught.value.__notes__ == ["datastates-hist: raised while collecting 'extra/sampler' for step 0"]
        ckpt.write(0, torch.nn.Linear(2, 2))  # nothing of the refused step was kept
    assert dh.open(run_dir).steps == [0]


# --- tensors the snapshot cannot copy ----------------------------------------------------

def two_tensor():
    from torch.testing._internal.two_tensor import TwoTensor  # a wrapper subclass, as torchao's quantized tensors

    return TwoTensor(torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0]))


def logging_tensor():
    from torch.testing._internal.logging_tensor import LoggingTensor  # __torch_dispatch__, no __tensor_flatten__

    return LoggingTensor(torch.tensor([1.0, 2.0]))


RESOLVE = "call .resolve_{0}() on it and checkpoint that tensor, which holds the same values"
PLAIN_ONLY = "only plain tensors (and DTensor) can be checkpointed: checkpoint the plain tensors it holds instead"

CONJ = "tensor '{}' is a conjugate view (its conjugate bit is set, as .conj() leaves it); " + RESOLVE.format("conj")

# (id, where: a buffer of the model or an extra, the tensor, the error, its message)
UNCOPYABLE_CASES = [
    ("a conjugate view", "model", lambda: torch.tensor([1 + 2j, 3 - 1j]).conj(), ValueError, CONJ.format("model/t")),
    ("a conjugate transpose", "extra", lambda: torch.tensor([[1 + 2j, 3j]], dtype=torch.complex128).mH, ValueError,
     CONJ.format("extra/t")),
    ("a negative view", "extra", lambda: torch.tensor([1 + 2j, 3 - 1j]).conj().imag, ValueError,
     "tensor 'extra/t' is a negative view (its negative bit is set, as .conj().imag leaves it); "
     + RESOLVE.format("neg")),
    ("a wrapper subclass", "model", two_tensor, TypeError,
     f"tensor 'model/t' is a torch.Tensor subclass (TwoTensor) that wraps other tensors; {PLAIN_ONLY}"),
    ("a wrapper subclass as an extra", "extra", two_tensor, TypeError,
     f"tensor 'extra/t' is a torch.Tensor subclass (TwoTensor) that wraps other tensors; {PLAIN_ONLY}"),
    ("a __torch_dispatch__ subclass", "model", logging_tensor, TypeError,
     f"tensor 'model/t' is a torch.Tensor subclass (LoggingTensor) with its own __torch_dispatch__; {PLAIN_ONLY}"),
]


@pytest.mark.parametrize("where, make, error, message", [c[1:] for c in UNCOPYABLE_CASES],
                         ids=[c[0] for c in UNCOPYABLE_CASES])
def test_tensors_the_snapshot_cannot_copy_are_refused_at_write(run_dir, backend, where, make, error, message):
    """Accepted, they failed the step later (at close() or the next write()) with torch's
    error naming no tensor, and nothing was committed."""
    model, extra = linear(), {}
    if where == "model":
        model.register_buffer("t", make())
    else:
        extra["t"] = make()
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        with pytest.raises(error) as info:
            ckpt.write(0, model, **extra)
        assert str(info.value) == message
        ckpt.wait()
        assert ckpt.steps() == [] and os.listdir(os.path.join(run_dir, "steps")) == []
        ckpt.write(0, linear(), t=torch.arange(3.0))
        ckpt.wait()
        assert ckpt.steps() == [0]
    assert dh.open(run_dir).steps == [0]


class Tagged(torch.Tensor):
    """A subclass that only tags a tensor, holding its bytes (no __torch_dispatch__): as_subclass makes one."""


def test_parameters_buffers_and_plain_subclasses_are_still_checkpointed(run_dir, backend):
    model = linear()
    model.kept = torch.nn.Buffer(torch.arange(3.0))
    model.register_buffer("tagged", torch.arange(4.0).as_subclass(Tagged))
    model.register_buffer("resolved", torch.tensor([1 + 2j, 3 - 1j]).conj().resolve_conj())
    extra = {"p": torch.nn.Parameter(torch.ones(2)), "s": torch.arange(5).as_subclass(Tagged),
             "b": torch.nn.Buffer(torch.zeros(2)), "n": torch.tensor([1 + 2j]).conj().imag.resolve_neg()}
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        ckpt.write(0, model, **extra)
        ckpt.wait()
        assert ckpt.steps() == [0]
    with dh.open(run_dir) as h:
        for name, t in [*model.state_dict().items(), *((f"extra/{k}", v) for k, v in extra.items())]:
            got = h.read(name, 0)
            assert got.dtype == t.dtype and torch.equal(got, t.as_subclass(torch.Tensor).detach()), name
        assert torch.equal(h.read("resolved", 0), torch.tensor([1 - 2j, 3 + 1j]))
        assert torch.equal(h.read("extra/n", 0), torch.tensor([-2.0]))
