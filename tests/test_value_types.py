"""Values come back with the types they were written with (format version 6): numpy
scalars as the same dtype and bits (``{"__numpy__": [dtype, number]}``), 0-d numpy
arrays with shape ``()``, in the writing process and in a new one, on every backend.
Plain Python values are stored as before (untagged), values written before version 6
decode as before, and what cannot be stored exactly is refused at ``write()``: a numpy
longdouble, a dict key holding a lone surrogate. A stored numpy dtype outside the
allow-list is damage (``CorruptionError``), never built."""

import json
import math
import os
import random
import sqlite3
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist import values
from datastates_hist.index import FORMAT_VERSION
from datastates_hist.layout import index_path
from datastates_hist.scalars import scalars_of
from datastates_hist.store import Store

ALLOWED = ("bool, int8, int16, int32, int64, uint8, uint16, uint32, uint64, float16, float32, "
           "float64, complex64, complex128")


def nan_of(dtype, bits: int):
    """The NaN of ``dtype`` with these bits (a sign and payload np.float32("nan") lacks)."""
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
    return uint(bits).view(dtype)


def scalars():
    """numpy scalars of every stored dtype, their edge values included."""
    out = {"bool_t": np.bool_(True), "bool_f": np.bool_(False)}
    for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64):
        info = np.iinfo(t)
        out[f"{t.__name__}_min"], out[f"{t.__name__}_max"] = t(info.min), t(info.max)
    for t in (np.float16, np.float32, np.float64):
        info, name = np.finfo(t), t.__name__
        out.update({f"{name}_third": t(1) / t(3), f"{name}_max": t(info.max),
                    f"{name}_tiny": t(info.smallest_subnormal), f"{name}_negzero": t(-0.0), f"{name}_inf": t("inf"), f"{name}_neginf": t("-inf"),
                    f"{name}_nan": t("nan")})
    out["float16_negnan"] = nan_of(np.float16, 0xFE00)
    out["float32_negnan"] = nan_of(np.float32, 0xFFC00000)  # the NaN of x86 arithmetic (0 * inf)
    out["float64_payload"] = nan_of(np.float64, 0x7FF8000000000123)
    out["complex64"] = np.complex64(complex(np.float32(0.1), -2.5))
    out["complex128_inf"] = np.complex128(complex(math.inf, math.nan))
    out["complex128_negzero"] = np.array([-0.0, math.inf]).view(np.complex128)[0]
    return out


def arrays_0d():
    return {"f32": np.array(2.5, dtype=np.float32), "i64": np.array(7), "b": np.array(True),
            "f16": np.array(-0.0, dtype=np.float16), "u8": np.array(250, dtype=np.uint8),
            "c64": np.array(1 - 1j, dtype=np.complex64)}


def describe(x):
    """What a value is, exactly: its type, and a numpy value's dtype, shape and bytes."""
    if isinstance(x, np.ndarray):
        return ["ndarray", x.dtype.str, list(x.shape), x.tobytes().hex()]
    if isinstance(x, np.generic):
        return [type(x).__name__, x.dtype.str, np.array(x).tobytes().hex()]
    if isinstance(x, dict):
        return ["dict", sorted([repr(k), describe(v)] for k, v in x.items())]
    if isinstance(x, (list, tuple)):
        return [type(x).__name__, [describe(v) for v in x]]
    if isinstance(x, float):
        return ["float", x.hex()]
    return [type(x).__name__, repr(x)]


class Sampler:
    """A sampler whose state dict holds a 0-d array and numpy scalars."""

    def __init__(self, pos=0, epoch=0):
        self.pos, self.epoch, self.weight = np.array(pos), np.uint16(epoch), np.float32(0.5)

    def state_dict(self):
        return {"pos": self.pos, "epoch": self.epoch, "weight": self.weight}

    def load_state_dict(self, sd):
        self.pos, self.epoch, self.weight = sd["pos"], sd["epoch"], sd["weight"]


def extras():
    return {"s": scalars(), "a": arrays_0d(), "x": np.array(2.5), "ema": np.float32(0.3),
            "mixed": {"n": 3, "f": 0.5, "t": (np.int8(-1), [np.float16(0.1), np.array(3)]),
                      np.int64(4): "int64 key", np.bool_(True): "bool key"}}


def run_in_new_process(tmp_path, code: str, *args) -> str:
    """Run ``code`` in a fresh interpreter, outside the repository (the package is installed)."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return out.stdout


RESTORE_EXTRAS = """
import json, sys, numpy as np, torch
import datastates_hist as dh
from test_value_types import Sampler, describe
with dh.Checkpointer(sys.argv[1]) as ckpt:
    sampler = Sampler()
    restored = ckpt.restore(0, torch.nn.Linear(2, 2), sampler=sampler)
got = {k: v for k, v in restored.extra.items() if k != "sampler"}
print(json.dumps([describe(got), describe(sampler.state_dict())]))
"""


def test_numpy_scalars_and_0d_arrays_come_back_as_written(tmp_path, backend):
    run = str(tmp_path / "run")
    model, want = torch.nn.Linear(2, 2), extras()
    with dh.Checkpointer(run, backend=backend) as ckpt:
        ckpt.write(0, model, sampler=Sampler(pos=7, epoch=65535), **want)
    want_sampler = Sampler(pos=7, epoch=65535).state_dict()
    # in this process
    with dh.Checkpointer(run) as ckpt:
        sampler = Sampler()
        restored = ckpt.restore(0, model, sampler=sampler)
    got = {k: v for k, v in restored.extra.items() if k != "sampler"}
    assert describe(got) == describe(want)
    assert describe(sampler.state_dict()) == describe(want_sampler)
    assert got["x"].shape == () and got["x"].dtype == np.float64 and got["x"] == 2.5
    assert sampler.pos.shape == () and sampler.pos.dtype == np.int64 and sampler.pos == 7
    assert type(got["ema"]) is np.float32 and got["ema"] == np.float32(0.3)
    assert type(got["s"]["uint64_max"]) is np.uint64 and got["s"]["uint64_max"] == 2 ** 64 - 1
    assert type(got["mixed"]["n"]) is int and type(got["mixed"]["f"]) is float
    assert got["mixed"][np.int64(4)] == "int64 key" and type(next(iter(got["mixed"]))) is str
    # in a new process
    out = run_in_new_process(tmp_path, "import sys; sys.path.insert(0, sys.argv[2])" + RESTORE_EXTRAS,
                             run, os.path.dirname(__file__))
    assert json.loads(out) == json.loads(json.dumps([describe(want), describe(want_sampler)]))


def test_the_stored_form_of_numpy_scalars(tmp_path):
    run = str(tmp_path / "run")
    with dh.Checkpointer(run, backend="hdf5") as ckpt:
        ckpt.write(0, torch.nn.Linear(2, 2), data={
            "ema": np.float32(0.3), "count": np.uint8(250), "ok": np.bool_(True), "inf": np.float16("-inf"),
            "nan": np.float32("nan"), "x86nan": nan_of(np.float32, 0xFFC00000), "c": np.complex64(1 + 2j),
            "py": [3, 0.5, True, math.nan]})
    store = Store(run)
    with store.open_step(0) as data:
        stored = data.values["items"]["extra/data"]
        version = json.loads(data.reader.manifest())["format_version"]
    store.close()
    assert stored == {
        "ema": {"__numpy__": ["float32", 0.30000001192092896]}, "count": {"__numpy__": ["uint8", 250]},
        "ok": {"__numpy__": ["bool", True]}, "inf": {"__numpy__": ["float16", {"__float__": "-inf"}]},
        "nan": {"__numpy__": ["float32", {"__float__": "nan"}]}, "x86nan": {"__numpy__": ["float32", "0xffc00000"]},
        "c": {"__numpy__": ["complex64", [1.0, 2.0]]},
        "py": [3, 0.5, True, {"__float__": "nan"}]}  # Python's values untagged, as before
    assert version == FORMAT_VERSION == 6
    conn = sqlite3.connect(index_path(run))
    assert conn.execute("SELECT value FROM meta WHERE key='format_version'").fetchall() == [("6",)]
    conn.close()


def test_plain_python_values_are_encoded_as_before():
    plain = {"i": 3, "big": 2 ** 70, "f": 0.1, "b": False, "s": "x", "n": None, "inf": -math.inf,
             "t": (1, 2.5), "l": [1, [2, "a"]], "k": {1: "one"}, "by": b"\x00"}
    assert values.encode(plain, "v") == {
        "i": 3, "big": 2 ** 70, "f": 0.1, "b": False, "s": "x", "n": None, "inf": {"__float__": "-inf"},
        "t": {"__tuple__": [1, 2.5]}, "l": [1, [2, "a"]], "k": {"__dict__": [[1, "one"]]}, "by": {"__bytes__": "AA=="}}
    # an IntEnum, a float subclass: as the Python number, as before
    import enum

    class Level(enum.IntEnum):
        HIGH = 2
    assert type(values.encode(Level.HIGH, "v")) is int
    assert type(values.encode(type("F", (float,), {})(0.5), "v")) is float


def test_rng_states_stay_on_the_fast_path(monkeypatch):
    """A list or tuple of plain ints (the RNG states of every write) is encoded as it is,
    without a call per element; so is the numpy RNG state as the RNG provider stores it."""
    from datastates_hist.torch_providers import _numpy_state

    calls = []
    encode = values._encode
    monkeypatch.setattr(values, "_encode", lambda *a: calls.append(1) or encode(*a))
    state = random.getstate()
    assert values.encode(state, "python RNG") == {"__tuple__": [state[0], {"__tuple__": list(state[1])}, None]}
    assert len(calls) == 1 + 3  # the tuple, then its three fields; the 625 ints in one go
    calls.clear()
    kind, keys, pos, has_gauss, gauss = _numpy_state()
    assert values.encode(_numpy_state(), "numpy RNG") == {"__tuple__": [kind, keys, pos, has_gauss, gauss]}
    assert len(calls) == 1 + 5  # the tuple, then its five fields; the 624 keys in one go


RESUME = """
import json, sys, numpy as np, torch
import datastates_hist as dh
run, start, end = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with dh.Checkpointer(run) as ckpt:
    restored = ckpt.restore(start, torch.nn.Linear(1, 1))
    ema, count = restored.extra["ema"], restored.extra["count"]
    rng = np.random.Generator(np.random.PCG64())
    rng.bit_generator.state = restored.extra["pcg64"]
    for step in range(start + 1, end):
        x = rng.random()
        ema = ema * 0.99 + 0.01 * x
        with np.errstate(over="ignore"):
            count = count + 7
print(json.dumps([type(ema).__name__, np.array(ema).tobytes().hex(), type(count).__name__, int(count),
                  float(np.random.random())]))
"""


def test_a_resumed_float32_ema_is_bit_identical(tmp_path, backend):
    """An EMA kept as np.float32 and a wrapping np.uint8 counter, updated from a PCG64
    generator: a new process resuming from step 4 ends with the same bits as the
    uninterrupted run (before version 6, ema came back a float64 and count an int)."""
    run, steps, start = str(tmp_path / "run"), 10, 4
    ema, count, rng = np.float32(0.3), np.uint8(250), np.random.Generator(np.random.PCG64(5))
    np.random.seed(1)
    model = torch.nn.Linear(1, 1)
    with dh.Checkpointer(run, backend=backend) as ckpt:
        for step in range(steps):
            if step > 0:
                x = rng.random()  # a Python float: np.float32 stays float32 (NEP 50), a float float64
                ema = ema * 0.99 + 0.01 * x
                with np.errstate(over="ignore"):  # it wraps around, as intended (an int would not)
                    count = count + 7
            ckpt.write(step, model, ema=ema, count=count, pcg64=rng.bit_generator.state)
            if step == start:
                after_start = float(np.random.random())  # the global RNG, restored with the step
    assert type(ema) is np.float32 and type(count) is np.uint8
    out = json.loads(run_in_new_process(tmp_path, RESUME, run, start, steps))
    assert out == ["float32", np.array(ema).tobytes().hex(), "uint8", int(count), after_start]


NUMPY_RNG = """
import json, sys, numpy as np, torch
import datastates_hist as dh
with dh.Checkpointer(sys.argv[1]) as ckpt:
    extra = ckpt.restore(0, torch.nn.Linear(1, 1)).extra
np.random.set_state(extra["legacy"])
draws = {"legacy": np.random.random(4).tolist()}
for name in ("pcg64", "mt19937", "philox", "sfc64"):
    bitgen = getattr(np.random, extra[name]["bit_generator"])()
    bitgen.state = extra[name]
    draws[name] = np.random.Generator(bitgen).random(4).tolist()
print(json.dumps(draws))
"""


def test_numpy_rng_states_restore_exactly(tmp_path, backend):
    """numpy's RNG states as extras (their keys are numpy arrays, PCG64's state 128-bit ints)
    restore in a new process to generators that draw the same numbers."""
    run = str(tmp_path / "run")
    np.random.seed(3)
    np.random.random(5)
    gens = {"pcg64": np.random.PCG64(1), "mt19937": np.random.MT19937(2), "philox": np.random.Philox(3),
            "sfc64": np.random.SFC64(4)}
    for g in gens.values():
        np.random.Generator(g).random(3)  # a state mid-stream (Philox's buffer, PCG64's has_uint32)
    np.random.Generator(gens["pcg64"]).integers(0, 2 ** 31, dtype=np.uint32)
    states = {name: g.state for name, g in gens.items()}
    with dh.Checkpointer(run, backend=backend) as ckpt:
        ckpt.write(0, torch.nn.Linear(1, 1), legacy=np.random.get_state(), **states)
    want = {"legacy": np.random.random(4).tolist(),
            **{name: np.random.Generator(g).random(4).tolist() for name, g in gens.items()}}
    assert json.loads(run_in_new_process(tmp_path, NUMPY_RNG, run)) == want


def test_numpy_numbers_are_scalars(tmp_path, backend):
    run = str(tmp_path / "run")
    with dh.Checkpointer(run, backend=backend) as ckpt:
        for step in range(2):
            ckpt.write(step, torch.nn.Linear(1, 1), data={
                "ema": np.float32(0.3) * step, "count": np.uint8(250 + step), "ok": np.bool_(step),
                "big": np.uint64(2 ** 64 - 1), "nan": np.float32("nan"), "c": np.complex64(1j),
                "by_id": {np.int64(7): np.float16(0.5)}, "loss": 1.5})
    with dh.open(run) as h:
        df = h.scalars()
    assert sorted(df.columns) == ["extra/data/big", "extra/data/by_id/7", "extra/data/count", "extra/data/ema",
                                  "extra/data/loss", "extra/data/nan", "extra/data/ok"]  # not complex
    assert df["extra/data/ema"].tolist() == [0.0, float(np.float32(0.3))]
    assert df["extra/data/count"].tolist() == [250, 251] and df["extra/data/count"].dtype == np.int64
    assert df["extra/data/ok"].tolist() == [0, 1]
    assert df["extra/data/big"].tolist() == [float(2 ** 64 - 1)] * 2  # beyond 64 bits signed: a float
    assert df["extra/data/by_id/7"].tolist() == [0.5, 0.5]
    assert df["extra/data/nan"].isna().all()


def test_values_written_before_version_6_decode_as_before():
    """numpy scalars were written as Python's numbers: they still decode as Python's."""
    old = {"ema": 0.30000001192092896, "count": 250, "ok": True, "nan": {"__float__": "nan"},
           "ids": {"__dict__": [[7, 0.5]]}, "pair": {"__tuple__": [1, 2.5]}}
    got = values.decode(old)
    assert describe(got) == describe({"ema": 0.30000001192092896, "count": 250, "ok": True, "nan": math.nan,
                                      "ids": {7: 0.5}, "pair": (1, 2.5)})
    assert type(got["ema"]) is float and type(got["count"]) is int and type(got["ok"]) is bool


def test_a_dict_keyed_numpy_written_before_version_6_is_a_dict(tmp_path, backend):
    """Version 5 stored a user's ``{"__numpy__": ...}`` dict as it was (not yet a tag): it
    reads back as that dict, in a restore, a rebuilt extra and the scalars."""
    from test_paths_and_sizes import rewrite_manifest

    run = str(tmp_path / "run")
    model = torch.nn.Linear(2, 2)
    with dh.Checkpointer(run, backend=backend, codec="raw") as ckpt:
        ckpt.write(0, model, data={"a": {"__numpy__": 3}, "b": [{"__numpy__": ["float32", 0.5]}]})

    def as_version_5(doc):
        assert doc["values"]["items"]["extra/data"] == {
            "a": {"__dict__": [["__numpy__", 3]]}, "b": [{"__dict__": [["__numpy__", ["float32", 0.5]]]}]}
        doc["format_version"] = 5
        doc["values"]["items"]["extra/data"] = {"a": {"__numpy__": 3}, "b": [{"__numpy__": ["float32", 0.5]}]}
    rewrite_manifest(run, 0, as_version_5)
    want = {"a": {"__numpy__": 3}, "b": [{"__numpy__": [np.float32.__name__, 0.5]}]}
    with dh.Checkpointer(run) as ckpt:
        got = ckpt.restore(0, model).extra["data"]  # rebuilt: not passed
        assert got == want and type(got["b"][0]["__numpy__"][1]) is float
        assert ckpt.restore(0, model, data={}).extra["data"] == want
    names = ["extra/data/a/__numpy__", "extra/data/b/0/__numpy__/1"]
    with dh.open(run) as h:
        assert h.scalar_names() == names
    from datastates_hist.cli import main

    assert main(["repair", run, "--force"]) == 0  # the index rebuilt from the manifests
    with dh.open(run) as h:
        assert h.scalar_names() == names


def test_a_step_of_a_newer_format_is_refused_by_a_reader_opened_before(tmp_path):
    """A reader open while a newer writer upgrades the run reads the new steps' manifests:
    one of a version it does not know is refused, not decoded by today's rules."""
    from test_paths_and_sizes import rewrite_manifest

    run = str(tmp_path / "run")
    with dh.Checkpointer(run, codec="raw") as ckpt:
        ckpt.write(0, torch.nn.Linear(2, 2), x=np.float32(1.5))
    h = dh.open(run)
    try:
        rewrite_manifest(run, 0, lambda doc: doc.update(format_version=FORMAT_VERSION + 1))
        with pytest.raises(dh.FormatError) as exc:
            h.read("extra/x", 0)
        assert str(exc.value) == (f"step 0 of {run} was written in format version {FORMAT_VERSION + 1}; this "
                                  f"datastates-hist reads up to version {FORMAT_VERSION}: upgrade datastates-hist")
    finally:
        h.close()


def test_verify_and_repair_name_a_step_of_a_newer_format_and_keep_it(tmp_path, capsys):
    from test_paths_and_sizes import rewrite_manifest
    from datastates_hist.cli import main
    from datastates_hist.verify import verify_run

    run = str(tmp_path / "run")
    with dh.Checkpointer(run, codec="raw") as ckpt:
        ckpt.write(0, torch.nn.Linear(2, 2))
        ckpt.write(1, torch.nn.Linear(2, 2))
    rewrite_manifest(run, 1, lambda doc: doc.update(format_version=FORMAT_VERSION + 1))
    newer = (f"written in format version {FORMAT_VERSION + 1}; this datastates-hist reads up to version "
             f"{FORMAT_VERSION}: upgrade datastates-hist")
    assert [(p.step, p.message) for p in verify_run(run)] == [
        (1, f"its data cannot be opened: step 1 of {run} was {newer}")]
    assert main(["repair", run, "--force"]) == 1
    assert f"not committed, moved to damaged/000000000001.bp: {newer}" in capsys.readouterr().out
    assert os.listdir(os.path.join(run, "damaged")) == ["000000000001.bp"]  # set aside, not deleted


@pytest.mark.parametrize("inner, says", [
    (["object", 1], f"a numpy scalar of dtype 'object', not one of the dtypes stored ({ALLOWED})"),
    (["float128", 1.0], f"a numpy scalar of dtype 'float128', not one of the dtypes stored ({ALLOWED})"),
    (["numpy.float32", 1.0], f"a numpy scalar of dtype 'numpy.float32', not one of the dtypes stored ({ALLOWED})"),
    ([np.float32.__name__], "a numpy scalar is stored as ['float32'], not [dtype, number]"),
    (["float32", 0.1], "a numpy float32 stored as 0.1, not a number it holds"),
    (["float16", 70000.0], "a numpy float16 stored as 70000.0, not a number it holds"),
    (["float32", "0x3f800000"], "a numpy float32 stored as '0x3f800000', not a number it holds"),
    (["float32", "0x7FC00001"], "a numpy float32 stored as '0x7FC00001', not a number it holds"),
    (["float64", 10 ** 400], f"a numpy float64 stored as {'1' + '0' * 59}..., not a number it holds"),
    (["uint8", 256], "a numpy uint8 stored as 256, not an integer it holds"),
    (["int8", True], "a numpy int8 stored as True, not an integer it holds"),
    (["bool", 1], "a numpy bool stored as 1"),
    (["complex64", [1.0]], "a numpy complex64 stored as [1.0], not [real, imaginary]"),
])
def test_a_malformed_numpy_scalar_is_damage(inner, says):
    with pytest.raises(dh.CorruptionError) as exc:
        values.decode({"x": {"__numpy__": inner}})
    assert str(exc.value) == f"a stored value is malformed (ValueError: {says})"


def test_a_crafted_dtype_name_in_a_run_is_refused_not_built(tmp_path, backend):
    from test_paths_and_sizes import rewrite_manifest

    run = str(tmp_path / "run")
    model = torch.nn.Linear(2, 2)
    with dh.Checkpointer(run, backend=backend, codec="raw") as ckpt:
        ckpt.write(0, model, x=np.float32(1.5))

    def edit(doc):
        assert doc["values"]["items"]["extra/x"] == {"__numpy__": ["float32", 1.5]}
        doc["values"]["items"]["extra/x"] = {"__numpy__": ["object", "os.system('touch pwned')"]}
    rewrite_manifest(run, 0, edit)
    with dh.Checkpointer(run) as ckpt:
        with pytest.raises(dh.CorruptionError) as exc:
            ckpt.restore(0, model)
    assert str(exc.value) == ("a stored value is malformed (ValueError: a numpy scalar of dtype 'object', "
                              f"not one of the dtypes stored ({ALLOWED}))")
    assert not (tmp_path / "pwned").exists()
    assert scalars_of({"extra/x": {"__numpy__": ["object", 1]}}) == {}  # names no number either


@pytest.mark.skipif(np.dtype(np.longdouble).itemsize <= 8, reason="longdouble is a float64 here")
def test_a_numpy_longdouble_is_refused(tmp_path):
    name = np.dtype(np.longdouble).name
    with dh.Checkpointer(tmp_path / "run", backend="hdf5") as ckpt:
        with pytest.raises(TypeError) as exc:
            ckpt.write(0, torch.nn.Linear(1, 1), data={"lr": np.longdouble(1) / 3})
        assert str(exc.value) == (
            f"cannot checkpoint 'extra/data': value/lr: a numpy scalar of dtype {name} cannot be stored "
            f"exactly (only {ALLOWED} can); convert it, e.g. with float()")
        with pytest.raises(TypeError) as exc:
            ckpt.write(0, torch.nn.Linear(1, 1), z=np.clongdouble(1j))
        assert str(exc.value) == (
            f"cannot checkpoint 'extra/z': value: a numpy scalar of dtype {np.dtype(np.clongdouble).name} cannot "
            f"be stored exactly (only {ALLOWED} can); convert it, e.g. with float()")
        with pytest.raises(TypeError) as exc:
            ckpt.write(0, torch.nn.Linear(1, 1), d=[np.timedelta64(3, "s")])
        assert str(exc.value) == ("cannot checkpoint 'extra/d': value/0: a numpy scalar of time durations "
                                  "(dtype timedelta64[s]) cannot be stored; only numbers and booleans can "
                                  "(convert it, e.g. with int())")
        ckpt.write(0, torch.nn.Linear(1, 1), data={"lr": float(np.longdouble(1) / 3)})  # nothing was left behind
        ckpt.wait()
        assert ckpt.steps() == [0]


@pytest.mark.parametrize("value, says", [
    ({"\udcff": 1}, "value: the dict key '\\udcff' is not valid Unicode (it holds a lone surrogate, '\\udcff' "
                    "at position 0)"),
    ({"a": [{"x\ud800y": torch.ones(1)}]}, "value/a/0: the dict key 'x\\ud800y' is not valid Unicode (it holds a "
                                           "lone surrogate, '\\ud800' at position 1)"),
    ({1: 2, "k\udcff": 3}, "value: the dict key 'k\\udcff' is not valid Unicode (it holds a lone surrogate, "
                           "'\\udcff' at position 1)"),
])
def test_a_dict_key_with_a_lone_surrogate_is_refused_at_write(tmp_path, backend, value, says):
    run = str(tmp_path / "run")
    model = torch.nn.Linear(2, 2)
    with dh.Checkpointer(run, backend=backend) as ckpt:
        with pytest.raises(TypeError) as exc:
            ckpt.write(0, model, d=value)
        assert str(exc.value) == (
            f"cannot checkpoint 'extra/d': {says} and cannot be stored: keys name the stored items, which are "
            "UTF-8; use a key of valid text (e.g. key.encode('utf-8', 'replace').decode()), or keep such a "
            "name in a value")
        ckpt.write(0, model, d={"name": "\udcff", "ok\u00e9": 1})  # a surrogate in a value, and valid text keys
    with dh.Checkpointer(run) as ckpt:
        assert ckpt.restore(0, model).extra["d"] == {"name": "\udcff", "ok\u00e9": 1}
        assert ckpt.steps() == [0]


def test_an_optimizer_option_key_with_a_lone_surrogate_is_refused():
    with pytest.raises(values.UnsupportedValueError) as exc:
        values.encode({"lr": 0.1, "b\udcff": 1}, "param_groups")
    assert str(exc.value).startswith("param_groups: the dict key 'b\\udcff' is not valid Unicode")
