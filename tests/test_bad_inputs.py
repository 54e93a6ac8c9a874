"""A table of bad inputs users hit, each with its exact error class and message.

``test_errors.py`` covers the first cases (a file as the run, steps that do
not grow, two writers in one process, mismatched models); this table adds the
rest. Every case also checks that nothing was committed by the bad call.
"""

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist import backends
from datastates_hist.backends import _adios2_capi
from datastates_hist.index import FORMAT_VERSION
from datastates_hist.items import TensorItem
from datastates_hist.providers import StateProvider, register_provider
from datastates_hist.store import Store


def linear(n_out=3):
    torch.manual_seed(0)
    return torch.nn.Linear(4, n_out)


def committed(run_dir, model=None, optimizer=None, steps=(0,), **extra):
    model = model if model is not None else linear()
    with dh.Checkpointer(run_dir) as ckpt:
        for s in steps:
            ckpt.write(s, model, optimizer, **extra)
    return model


@contextlib.contextmanager
def read_only(path):
    """``path`` (a new folder) on a read-only file system: a tmpfs remounted
    read-only when root (root ignores permission bits), else mode 0o555."""
    os.makedirs(path)
    if os.geteuid() != 0:
        yield lambda: os.chmod(path, 0o555)
        os.chmod(path, 0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", path]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield lambda: subprocess.run(["mount", "-o", "remount,ro", path], check=True)
    finally:
        subprocess.run(["umount", "-l", path])


# --- the cases: each runs the bad call last --------------------------------------------

def run_inside_a_file(tmp):
    (tmp / "file").write_text("x")
    dh.Checkpointer(tmp / "file" / "run")


def new_run_on_read_only_fs(tmp):
    with read_only(str(tmp / "ro")) as freeze:
        freeze()
        dh.Checkpointer(tmp / "ro" / "run")


def existing_run_on_read_only_fs(tmp):
    with read_only(str(tmp / "ro")) as freeze:
        committed(str(tmp / "ro" / "run"))
        freeze()
        assert Store(str(tmp / "ro" / "run")).steps() == [0]  # reading it still works
        dh.Checkpointer(tmp / "ro" / "run")


def newer_format_for_a_reader(tmp):
    import sqlite3

    run = str(tmp / "run")
    committed(run)
    conn = sqlite3.connect(os.path.join(run, "index.sqlite"))
    with conn:
        conn.execute("UPDATE meta SET value=? WHERE key='format_version'", (str(FORMAT_VERSION + 1),))
    conn.close()
    Store(run)


LOCK_HOLDER = r"""
import sys, time, datastates_hist as dh
ckpt = dh.Checkpointer(sys.argv[1])
print("locked", flush=True)
time.sleep(60)
"""


def writer_in_another_process(tmp):
    run = str(tmp / "run")
    child = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, run], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        dh.Checkpointer(run)
    finally:
        child.kill()
        child.wait()
        dh.Checkpointer(run).close()  # the kernel dropped the lock with the process


def step_equal_to_one_in_flight(tmp):
    ckpt = dh.Checkpointer(tmp / "run")
    try:
        ckpt.write(1, linear())
        ckpt.write(1, linear())
    finally:
        ckpt.close()


def write_step(step):
    def case(tmp):
        with dh.Checkpointer(tmp / "run") as ckpt:
            ckpt.write(step, linear())
    return case


def model_with_an_added_layer(tmp):
    committed(str(tmp / "run"), torch.nn.Sequential(torch.nn.Linear(4, 3)))
    with dh.Checkpointer(tmp / "run") as ckpt:
        ckpt.restore(model=torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)))


def model_with_a_reshaped_layer(tmp):
    committed(str(tmp / "run"), torch.nn.Sequential(torch.nn.Linear(4, 3)))
    with dh.Checkpointer(tmp / "run") as ckpt:
        ckpt.restore(model=torch.nn.Sequential(torch.nn.Linear(4, 8)))


def optimizer_of_other_parameters(tmp):
    model = linear()
    committed(str(tmp / "run"), model, torch.optim.SGD(model.parameters(), lr=0.1))
    other = torch.nn.Linear(4, 3)  # its parameters are not the model's
    with dh.Checkpointer(tmp / "run") as ckpt:
        ckpt.restore(model=model, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


def optimizer_of_another_type(tmp):
    model = linear()
    committed(str(tmp / "run"), model, torch.optim.SGD(model.parameters(), lr=0.1))
    with dh.Checkpointer(tmp / "run") as ckpt:
        ckpt.restore(model=model, optimizer=torch.optim.AdamW(model.parameters()))


def scheduler_of_another_type(tmp):
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    committed(str(tmp / "run"), model, opt, sched=torch.optim.lr_scheduler.StepLR(opt, 3))
    with dh.Checkpointer(tmp / "run") as ckpt:
        ckpt.restore(model=model, optimizer=opt, sched=torch.optim.lr_scheduler.ExponentialLR(opt, 0.9))


def extra_not_in_the_step(tmp):
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    committed(str(tmp / "run"), model, opt)
    with dh.Checkpointer(tmp / "run") as ckpt:
        ckpt.restore(model=model, optimizer=opt, sched=torch.optim.lr_scheduler.StepLR(opt, 3))


def nonfinite_refused(value, where):
    def case(tmp):
        model = linear()
        tensor = torch.ones(3)
        tensor[1:] = value
        if where == "model":
            with torch.no_grad():
                model.weight[0, 0] = value
        with dh.Checkpointer(tmp / "run", refuse_nonfinite=True) as ckpt:
            ckpt.write(0, model, **({"x": tensor} if where == "extra" else {}))
            try:
                ckpt.wait()
            finally:
                assert ckpt.steps() == []
    return case


def write_extra(**extra):
    """Write ``extra``; callables among its values make them (experimental dtypes warn)."""
    def case(tmp):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            made = {k: v() if callable(v) and not isinstance(v, type(len)) else v for k, v in extra.items()}
        with dh.Checkpointer(tmp / "run") as ckpt:
            try:
                ckpt.write(0, linear(), **made)
            finally:
                assert ckpt.steps() == []
    return case


def model_on_meta(tmp):
    with torch.device("meta"):
        model = torch.nn.Linear(4, 3)
    with dh.Checkpointer(tmp / "run") as ckpt:
        ckpt.write(0, model)


def restore_into_meta_model(tmp):
    committed(str(tmp / "run"))
    with torch.device("meta"):
        model = torch.nn.Linear(4, 3)
    with dh.Checkpointer(tmp / "run") as ckpt:
        ckpt.restore(model=model)


class Opaque:
    """An object with no state_dict and no registered provider."""


def missing_h5py(tmp, monkeypatch):
    monkeypatch.setattr(backends, "_REGISTERED", {k: v for k, v in backends._REGISTERED.items() if k != "hdf5"})
    monkeypatch.setitem(sys.modules, "h5py", None)
    monkeypatch.delitem(sys.modules, "datastates_hist.backends.hdf5", raising=False)
    try:
        dh.Checkpointer(tmp / "run", backend="hdf5")
    finally:
        monkeypatch.undo()
        dh.Checkpointer(tmp / "run", backend="hdf5").close()  # the failed open released its lock


def missing_adios2(tmp, monkeypatch):
    monkeypatch.setattr(backends, "_REGISTERED", {k: v for k, v in backends._REGISTERED.items() if k != "adios2"})
    monkeypatch.setattr(_adios2_capi, "_lib", None)
    monkeypatch.setitem(sys.modules, "adios2", None)
    dh.Checkpointer(tmp / "run", backend="adios2")


def restore_step(step):
    def case(tmp):
        committed(str(tmp / "run"))
        with dh.Checkpointer(tmp / "run") as ckpt:
            ckpt.restore(step, model=linear())
    return case


def step_data_deleted(tmp):
    committed(str(tmp / "run"), steps=(0, 1))
    steps = tmp / "run" / "steps"
    shutil.rmtree(steps / sorted(os.listdir(steps))[1])
    with dh.Checkpointer(tmp / "run") as ckpt:
        assert ckpt.restore(0, model=linear()).step == 0
        ckpt.restore(model=linear())


def index_not_a_database(tmp):
    os.makedirs(tmp / "run" / "steps")
    (tmp / "run" / "index.sqlite").write_bytes(b"SQLite format 2\x00" + b"\x01" * 200)
    dh.Checkpointer(tmp / "run")


def index_lost(tmp):
    committed(str(tmp / "run"), steps=(0, 1))
    os.remove(tmp / "run" / "index.sqlite")
    try:
        dh.Checkpointer(tmp / "run")
    finally:
        assert len(os.listdir(tmp / "run" / "steps")) == 2  # nothing was deleted


def folder_that_is_not_a_run(tmp):
    os.makedirs(tmp / "photos")
    Store(str(tmp / "photos"))


def truncate_after_a_name(tmp):
    committed(str(tmp / "run"))
    with dh.Checkpointer(tmp / "run") as ckpt:
        ckpt.truncate(after="latest")


def tiny_host_cache(tmp):
    with dh.Checkpointer(tmp / "run", host_cache_bytes=16) as ckpt:
        ckpt.write(0, linear())


def opening_with(**options):
    """Open a run with ``options``; refused before anything is created."""
    def case(tmp):
        try:
            dh.Checkpointer(tmp / "run", **options).close()
        finally:
            assert not (tmp / "run").exists()
    return case


class Sharded:
    """An object whose provider yields one shard of a larger tensor."""


class ShardProvider(StateProvider):
    def items(self, obj, ctx):
        yield TensorItem("w", torch.zeros(4, 4), global_shape=(8, 4), offset=(6, 0))

    def load(self, obj, state, ctx):
        return obj


def shard_outside_its_global_shape(tmp):
    register_provider(Sharded, ShardProvider())
    with dh.Checkpointer(tmp / "run") as ckpt:
        ckpt.write(0, linear(), shard=Sharded())


def comm_of_an_unknown_kind(tmp):
    dh.Checkpointer(tmp / "run", comm=3)


def backend_option_it_does_not_take(tmp):
    try:
        dh.Checkpointer(tmp / "run", backend="hdf5", backend_options={"parameters": {"NumAggregators": "2"}})
    finally:
        dh.Checkpointer(tmp / "run").close()  # the failed open gave the lock back


def provider_that_is_not_one(tmp):
    register_provider(Opaque, lambda obj: obj)


CASES = [
    # (id, case, error class, message fragment: a regular expression)
    ("run inside a file", run_inside_a_file, NotADirectoryError, r"Not a directory"),
    ("new run on a read-only file system", new_run_on_read_only_fs, PermissionError,
     r"cannot create the run directory .*/ro/run: (Read-only file system|Permission denied)"),
    ("writer on a read-only file system", existing_run_on_read_only_fs, PermissionError,
     r"the run directory .*/ro/run is not writable"),
    ("reader of a newer format", newer_format_for_a_reader, dh.FormatError,
     rf"written in format version {FORMAT_VERSION + 1}; this datastates-hist reads up to version {FORMAT_VERSION}: "
     r"upgrade datastates-hist"),
    ("second writer in another process", writer_in_another_process, dh.StoreLockedError,
     rf"run is being written by pid (?!{os.getpid()})\d+ on {socket.gethostname()}; one writer per run"),
    ("step equal to one in flight", step_equal_to_one_in_flight, dh.StepOrderError, r"step 1 is not after step 1"),
    ("step as a float", write_step(1.5), ValueError, r"step must be a non-negative int, got 1\.5"),
    ("step as a bool", write_step(True), ValueError, r"step must be a non-negative int, got True"),
    ("step as a string", write_step("3"), ValueError, r"step must be a non-negative int, got '3'"),
    ("model with an added layer", model_with_an_added_layer, dh.RestoreMismatchError,
     r"missing from the step \(2\): model/2\.weight, model/2\.bias"),
    ("model with a reshaped layer", model_with_a_reshaped_layer, dh.RestoreMismatchError,
     r"model/0\.weight: expected float32\[8, 4\], found float32\[3, 4\]"),
    ("optimizer of other parameters", optimizer_of_other_parameters, dh.RestoreMismatchError,
     r"missing from the step \(2\): optim/param @0, optim/param @1"),
    ("optimizer of another type", optimizer_of_another_type, dh.RestoreMismatchError,
     r"optim/param_groups: expected AdamW, found SGD"),
    ("scheduler of another type", scheduler_of_another_type, dh.RestoreMismatchError,
     r"expected ExponentialLR, found StepLR"),
    ("restore of an extra the step lacks", extra_not_in_the_step, dh.RestoreMismatchError,
     r"missing from the step \(1\): extra/sched"),
    ("NaN refused in the model", nonfinite_refused(float("nan"), "model"), dh.CheckpointError,
     r"step 0 .*tensor 'model/weight' holds 1 NaN or infinite value\(s\); refused because refuse_nonfinite=True"),
    ("Inf refused in an extra", nonfinite_refused(float("inf"), "extra"), dh.CheckpointError,
     r"tensor 'extra/x' holds 2 NaN or infinite value\(s\)"),
    ("model on the meta device", model_on_meta, ValueError,
     r"tensor 'model/weight' is on the meta device and has no data to checkpoint"),
    ("restore into a meta model", restore_into_meta_model, dh.RestoreMismatchError,
     r"model/weight: expected a tensor with data, found a meta tensor: materialize the model first"),
    ("nested tensor", write_extra(n=lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])), TypeError,
     r"tensor 'extra/n' is a nested tensor; only dense tensors can be checkpointed"),
    ("quantized tensor", write_extra(q=lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8)),
     TypeError, r"tensor 'extra/q' has dtype torch\.quint8, which cannot be stored"),
    ("complex32 tensor", write_extra(c=lambda: torch.zeros(2, dtype=torch.complex32)), TypeError,
     r"tensor 'extra/c' has dtype torch\.complex32, which cannot be stored"),
    ("a set value", write_extra(tags={"a", "b"}), TypeError,
     r"cannot checkpoint 'extra/tags': value: a value of type builtins\.set cannot be stored without pickle"),
    ("a function value", write_extra(fn=len), TypeError,
     r"'extra/fn'.*type builtins\.builtin_function_or_method cannot be stored without pickle"),
    ("a numpy object array", write_extra(a=np.array([object()])), TypeError,
     r"'extra/a'.*type numpy\.ndarray cannot be stored without pickle"),
    ("an object without state_dict", write_extra(o=Opaque()), TypeError,
     r"'extra/o'.*type test_bad_inputs\.Opaque cannot be stored without pickle; .*register a StateProvider"),
    ("missing h5py", missing_h5py, ImportError,
     r"the 'hdf5' backend cannot be used: .*h5py.* \(pip install h5py\)"),
    ("missing adios2", missing_adios2, ImportError, r"the ADIOS2 backend needs the 'adios2' package: pip install adios2"),
    ("restore step as a string", restore_step("0"), TypeError,
     r"restore\(\) needs a step number \(int\) or None for the newest, got '0'"),
    ("restore a negative step", restore_step(-1), dh.StepNotFoundError,
     r"step -1 is not committed in .* \(committed steps: 0\.\.0 \(1\)\)"),
    ("step data deleted by hand", step_data_deleted, dh.CorruptionError,
     r"step 1 is committed in .* but its data is missing"),
    ("index that is not a database", index_not_a_database, dh.CorruptionError,
     r"index\.sqlite is damaged \(.*\); rebuild it from the step data with: datastates-hist repair"),
    ("index lost beside step data", index_lost, dh.CorruptionError,
     r"holds 2 step\(s\) of data but no index .*nothing was changed\. Rebuild the index with: datastates-hist repair"),
    ("a folder that is not a run", folder_that_is_not_a_run, dh.StoreNotFoundError,
     r"photos is not a datastates-hist run \(no index\.sqlite\)"),
    ("truncate after a name", truncate_after_a_name, TypeError,
     r"truncate\(after=\.\.\.\) needs a step number \(int\), got 'latest'"),
    ("host cache too small", tiny_host_cache, ValueError,
     r"^host cache of 16 bytes is too small: host_cache_bytes must be at least 64$"),
    ("host cache in a string", opening_with(host_cache_bytes="1GB"), TypeError,
     r"^host_cache_bytes must be a whole number of bytes, got '1GB'$"),
    ("piece bytes as a float", opening_with(piece_bytes=2.5e6), TypeError,
     r"^piece_bytes must be a whole number of bytes, got 2500000\.0$"),
    ("no piece bytes", opening_with(piece_bytes=0), ValueError, r"^piece_bytes must be at least 1, got 0$"),
    ("shard outside its global shape", shard_outside_its_global_shape, ValueError,
     r"shard 'extra/shard/w' of shape \[4, 4\] at offset \[6, 0\] does not fit its global shape \[8, 4\]"),
    ("provider that is not a StateProvider", provider_that_is_not_one, TypeError, r"is not a StateProvider"),
    ("comm of an unknown kind", comm_of_an_unknown_kind, TypeError,
     r"comm must be an mpi4py communicator, a torch.distributed process group or 'torch', got int"),
    ("backend option it does not take", backend_option_it_does_not_take, TypeError,
     r"backend 'hdf5' does not take the options \['parameters'\]"),
]


@pytest.mark.parametrize("case, error, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_error(tmp_path, monkeypatch, case, error, message):
    args = (tmp_path, monkeypatch) if case.__code__.co_argcount == 2 else (tmp_path,)
    with pytest.raises(error, match=message):
        case(*args)


def test_the_table_is_large_enough():
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)


def test_nonfinite_values_are_stored_and_counted_by_default(run_dir):
    t = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(0, linear(), x=t)
    store = Store(run_dir)
    (rec,) = [r for r in store.records(0) if r.name == "extra/x"]
    store.close()
    assert rec.stats["nonfinite"] == 3
    with dh.Checkpointer(run_dir) as ckpt:
        back = ckpt.restore(model=linear()).extra["x"]
    assert torch.equal(back.isnan(), t.isnan()) and torch.equal(back[~t.isnan()], t[~t.isnan()])


def test_a_refused_step_does_not_stop_training(run_dir):
    model = linear()
    with dh.Checkpointer(run_dir, refuse_nonfinite=True) as ckpt:
        ckpt.write(0, model)
        ckpt.write(1, model, x=torch.tensor([float("nan")]))
        with pytest.raises(dh.CheckpointError, match="step 1 .*'extra/x' holds 1 NaN"):
            ckpt.wait()
        ckpt.write(2, model)
        ckpt.wait()
        assert ckpt.steps() == [0, 2]
    assert not any(f.endswith(".partial") for f in os.listdir(os.path.join(run_dir, "steps")))


def test_a_failed_open_releases_the_writer_lock(run_dir):
    import sqlite3

    committed(run_dir)
    conn = sqlite3.connect(os.path.join(run_dir, "index.sqlite"))
    with conn:
        conn.execute("UPDATE meta SET value='9' WHERE key='format_version'")
    with pytest.raises(dh.FormatError):
        dh.Checkpointer(run_dir)
    with conn:
        conn.execute("UPDATE meta SET value='1' WHERE key='format_version'")
    conn.close()
    with dh.Checkpointer(run_dir) as ckpt:  # not StoreLockedError naming this very process
        assert ckpt.steps() == [0]


def test_cli_errors_for_bad_runs(tmp_path, capsys):
    from datastates_hist.cli import main

    (tmp_path / "file").write_text("x")
    assert main(["verify", str(tmp_path / "file")]) == 3
    assert "no run at" in capsys.readouterr().err
    assert main(["repair", str(tmp_path / "nothing")]) == 3
    assert "no run at" in capsys.readouterr().err
    run = str(tmp_path / "run")
    committed(run)
    with dh.Checkpointer(run):
        assert main(["repair", run, "--force"]) == 5
        assert "is being written by a Checkpointer of this process that was not closed" in capsys.readouterr().err


def test_policy_counts_are_whole_numbers_numpy_ones_too(run_dir):
    assert dh.KeepLast(np.int64(2)) == dh.KeepLast(2) and type(dh.KeepLast(np.int64(2)).n) is int
    assert dh.KeepEvery(np.int32(5)) == dh.KeepEvery(5)
    assert dh.Trajectory("model/*", every=np.int64(3)).every == 3
    for make, value, message in [(dh.KeepLast, 0, "KeepLast needs a whole number >= 1, got 0"),
                                 (dh.KeepLast, 2.0, "KeepLast needs a whole number >= 1, got 2.0"),
                                 (dh.KeepLast, True, "KeepLast needs a whole number >= 1, got True"),
                                 (dh.KeepEvery, "25", "KeepEvery needs a whole number >= 1, got '25'"),
                                 (dh.KeepEvery, np.int64(-1), f"KeepEvery needs a whole number >= 1, got {np.int64(-1)!r}")]:
        with pytest.raises(ValueError) as err:
            make(value)
        assert str(err.value) == message
    with dh.Checkpointer(run_dir, codec="raw") as ckpt:
        for step in range(5):
            ckpt.write(step, linear())
        assert ckpt.prune(keep_last=np.int64(2)) == [0, 1, 2]
        assert ckpt.steps() == [3, 4]


def test_run_paths_of_every_kind_and_none_that_is_no_path(run_dir):
    with dh.Checkpointer(os.fsencode(run_dir)) as ckpt:  # bytes, as os.fsencode gives them
        ckpt.write(0, linear())
        assert ckpt.path == str(run_dir)
    for path in (run_dir, str(run_dir), os.fsencode(run_dir)):
        with dh.open(path) as h:
            assert h.path == str(run_dir) and h.steps == [0]
    for make in (dh.Checkpointer, dh.open):
        for path in (5, None):
            with pytest.raises(TypeError) as err:
                make(path)
            assert str(err.value) == f"a run path is a str, bytes or os.PathLike, got {path!r}"
    for bad in (0, -1, 1.0, "2"):  # with none kept open, the step just read would be closed
        with pytest.raises(ValueError) as err:
            dh.History(run_dir, max_open_steps=bad)
        assert str(err.value) == f"max_open_steps needs a whole number >= 1, got {bad!r}"
    with dh.History(run_dir, max_open_steps=np.int64(1)) as h:
        assert torch.equal(h.read("model/weight", 0), h.read("model/weight", np.int64(0)))
