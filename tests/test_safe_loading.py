"""A store from elsewhere cannot run code: no load path unpickles anything.

A real pickle payload (its ``__reduce__`` runs ``exec`` that writes a marker
file) is planted everywhere a naive loader might unpickle it: as the bytes of
a tensor (stored as a key and as a delta, in a restore point's two units and
in a trajectory point), as a bytes value, under pickle-like tags in values, as
``.pkl`` and ``.pt`` files in the run, as a step unit the index points to,
inside a crafted HDF5 step whose manifest is valid, and inside a crafted
encoded step (a compressed key and a chunk stored raw, both decompressing to
the payload, and a delta against the crafted step). ``restore``, ``Store``, the CLI
(``ls``, ``show``, ``verify``, ``repair``), ``dh.open`` and the xarray engine
then read it all; the marker never appears, and an audit hook sees no
unpickling at all (``pickle.find_class`` and calls of ``pickle.load(s)``,
``torch.load``, ``numpy.load``).
"""

import base64
import json
import os
import pickle
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist.codecs import Encoder
from datastates_hist.commit import manifest_bytes
from datastates_hist.digest import checksum_bytes
from datastates_hist.index import Index, StepRow
from datastates_hist.items import TensorRecord
from test_history_tiers import NewestOnly


class Payload:
    """Unpickling this runs ``exec``, which writes ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def payload(marker) -> bytes:
    return pickle.dumps(Payload(marker))


def test_the_payload_is_live(tmp_path):
    """The payload does run code when unpickled: by pickle, and by torch.load without weights_only."""
    pickle.loads(payload(tmp_path / "by-pickle"))
    assert (tmp_path / "by-pickle").read_text() == "pwned"
    torch.save(Payload(tmp_path / "by-torch"), tmp_path / "evil.pt")
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert (tmp_path / "by-torch").read_text() == "pwned"


def plant_in_a_written_run(run_dir, marker, backend):
    """A run written through the API, carrying the payload as data, plus stray pickle files.

    Encoded as by default, with a history: step 1 a restore point (the payload, a
    trajectory tensor, a delta against step 0 in its main unit; the optimizer's in its
    restore unit), step 0 a trajectory point (its restore unit demoted away). The policy
    keeps the newest step; being the test's own, it cannot say that step 1 goes later, so
    step 1's restore unit is compressed too (KeepLast's would be raw)."""
    blob = payload(marker)
    model = torch.nn.Linear(4, 3)
    with dh.Checkpointer(run_dir, backend=backend, keep=NewestOnly(),
                         trajectory=dh.Trajectory("model/*", "extra/blob")) as ckpt:
        for step in range(2):
            ckpt.write(step, model, torch.optim.SGD(model.parameters(), lr=0.1),
                       blob=torch.frombuffer(bytearray(blob), dtype=torch.uint8),
                       cfg={"payload": blob, "__reduce__": base64.b64encode(blob).decode(),
                            "py/reduce": [{"py/function": "builtins.exec"}]})
    for path in (os.path.join(run_dir, "steps", "000000000001.pkl"), os.path.join(run_dir, "state.pkl")):
        with open(path, "wb") as f:
            f.write(blob)
    torch.save(Payload(marker), os.path.join(run_dir, "steps", "000000000002.pt"))
    return blob


def plant_crafted_steps(run_dir, marker):
    """Steps 5 and 6 added by hand: a valid HDF5 step whose tensor bytes and values are
    the payload under pickle-like tags, and a row pointing at a pickle posing as a step."""
    blob = payload(marker)
    records = [TensorRecord("model/weight", "uint8", (len(blob),), len(blob), checksum_bytes(blob), "raw")]
    values = {"items": {"extra/cfg": {"__pickle__": base64.b64encode(blob).decode()},
                        "extra/obj": {"py/object": "builtins.exec", "py/reduce": blob.hex()}},
              "objects": {"model": "ModuleProvider", "extra/cfg": "TreeProvider",
                          "extra/obj": "PickleProvider"}}
    manifest = manifest_bytes(5, records, values)
    with h5py.File(os.path.join(run_dir, "steps", "000000000005.h5"), "w") as f:
        f.create_dataset("__manifest__", data=np.frombuffer(manifest, dtype=np.uint8))
        ds = f.create_dataset("model/weight", data=np.frombuffer(blob, dtype=np.uint8))
        ds.attrs["pickle"] = np.void(blob)
    with open(os.path.join(run_dir, "steps", "000000000006.h5"), "wb") as f:
        f.write(blob)
    index = Index(run_dir, create=True)
    index.commit_step(StepRow(5, 0.0, "hdf5", "000000000005.h5", len(blob), 1, "full",
                              checksum_bytes(manifest)), records)
    index.commit_step(StepRow(6, 0.0, "hdf5", "000000000006.h5", 0, 0, "full", checksum_bytes(blob)), [])
    index.close()


def encoded(data: np.ndarray, base: np.ndarray | None = None):
    """``(stored bytes, chunk table)`` of uint8 ``data`` as a key, or as a delta against ``base``."""
    encoder = Encoder("uint8", delta=base is not None)
    encoder.add(data, base)
    blob, chunks, _ = encoder.finish()
    return blob, chunks


def plant_crafted_encoded_step(run_dir, marker):
    """Step 7 added by hand: a valid HDF5 step of encoded tensors whose decoded bytes are
    the payload: ``model/weight`` a delta against step 5's (the payload), ``extra/key`` a
    key stored raw (incompressible), ``extra/packed`` a compressed key of the payload
    repeated."""
    blob = np.frombuffer(payload(marker), np.uint8)
    tensors = {"model/weight": (blob, *encoded(blob, base=blob), 5), "extra/key": (blob, *encoded(blob), None),
               "extra/packed": (np.tile(blob, 64), *encoded(np.tile(blob, 64)), None)}
    records = [TensorRecord(name, "uint8", (len(raw),), len(raw), checksum_bytes(raw),
                            "key" if base is None else "delta", stored=len(stored), chunks=chunks, base=base)
               for name, (raw, stored, chunks, base) in tensors.items()]
    assert [r.chunks[0][2] for r in records] == [0, 1, 0]  # compressed, stored raw, compressed
    manifest = manifest_bytes(7, records, {"items": {}, "objects": {"model": "ModuleProvider"}})
    with h5py.File(os.path.join(run_dir, "steps", "000000000007.h5"), "w") as f:
        f.create_dataset("__manifest__", data=np.frombuffer(manifest, dtype=np.uint8))
        for name, (_raw, stored, _chunks, _base) in tensors.items():
            f.create_dataset(name, data=stored)
    index = Index(run_dir, create=True)
    index.commit_step(StepRow(7, 0.0, "hdf5", "000000000007.h5", sum(r.nbytes for r in records), len(records),
                              "full", checksum_bytes(manifest)), records)
    index.close()


READER = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
# Libraries first: dask, imported by xarray, pickles its own functions at import time.
import pickle, numpy, torch, xarray as xr
try:
    import dask.array, dask.delayed
except ImportError:
    pass
import datastates_hist as dh
from datastates_hist.restore import restore_step
from datastates_hist.cli import main as cli
from datastates_hist.repair import repair_run
from datastates_hist.store import Store

events = []
sys.addaudithook(lambda event, args: events.append(f"{event} {args}") if event == "pickle.find_class" else None)
for module, name in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load"), (numpy, "load")]:
    def spy(*a, _name=f"{module.__name__}.{name}", _orig=getattr(module, name), **k):
        events.append(_name)
        return _orig(*a, **k)
    setattr(module, name, spy)

run = sys.argv[1]
results = {}

def attempt(label, fn):
    try:
        results[label] = ["ok", repr(fn())[:300]]
    except Exception as exc:
        results[label] = [type(exc).__name__, str(exc)[:300]]

def read_all(step):
    store = Store(run)
    try:
        with store.open_step(step) as data:
            return {name: data.read(name).shape for name in data.records}
    finally:
        store.close()

def history(step):
    with dh.open(run) as h:
        return [h.read(name, step).shape for name in h.names(step)], len(h.tensors(step))

steps = json.loads(sys.argv[2])
attempt("cli ls", lambda: cli(["ls", run, "--json"]))
attempt("cli verify", lambda: cli(["verify", run, "--json"]))
for step in steps:
    attempt(f"cli show {step}", lambda: cli(["show", run, str(step), "--json"]))
    attempt(f"store {step}", lambda: read_all(step))
    attempt(f"restore {step}", lambda: restore_step(run, step, torch.nn.Linear(4, 3), None, strict=False,
                                                    rng=False, extra={}).extra)
    attempt(f"history {step}", lambda: history(step))
attempt("xarray", lambda: xr.open_dataset(run, engine="datastates", steps=[s for s in steps if s < 2]).load().sizes)
attempt("repair", lambda: repair_run(run, force=True).set_aside)
print(json.dumps({"events": events, "results": results}))
"""


def read_everything(run_dir, steps):
    out = subprocess.run([sys.executable, "-c", READER, run_dir, json.dumps(steps)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    return report["events"], report["results"]


def test_no_load_path_runs_a_planted_pickle(tmp_path, backend):
    run_dir, marker = str(tmp_path / "run"), tmp_path / "pwned"
    blob = plant_in_a_written_run(run_dir, marker, backend)
    plant_crafted_steps(run_dir, marker)
    plant_crafted_encoded_step(run_dir, marker)
    with dh.open(run_dir) as h:  # the written steps are encoded, in both tiers
        assert h.restore_points == [1, 5, 6, 7]
        assert h.tensors(0).set_index("name")["encoding"].to_dict() == {
            "extra/blob": "key", "model/bias": "key", "model/weight": "key"}
        assert h.tensors(1).set_index("name")["encoding"]["extra/blob"] == "delta"
        assert set(h.tensors(1).set_index("name")["encoding"]) == {"key", "delta"}
    events, results = read_everything(run_dir, [0, 1, 5, 6, 7])
    assert not marker.exists()
    assert events == []  # nothing was even unpickled
    for step in (0, 1, 7):  # the written and encoded steps read normally, the payload as plain data
        for what in ("store", "restore", "history", "cli show"):
            assert results[f"{what} {step}"][0] == "ok", results[f"{what} {step}"]
    assert results["xarray"][0] == "ok", results["xarray"]
    for step in (0, 1):
        assert "'extra/blob': torch.Size([%d])" % len(blob) in results[f"store {step}"][1]
    assert results["store 7"][1] == ("{'model/weight': torch.Size([%d]), 'extra/key': torch.Size([%d]), "
                                     "'extra/packed': torch.Size([%d])}" % (len(blob), len(blob), 64 * len(blob)))
    # the crafted steps: 5 reads as bytes and dicts of strings, 6 is named as damaged
    assert results["store 5"][0] == "ok" and results["history 5"][0] == "ok"
    assert results["restore 5"][0] == "ok"
    assert "'__pickle__'" in results["restore 5"][1] and "'py/object': 'builtins.exec'" in results["restore 5"][1]
    for what in ("store 6", "restore 6"):
        assert results[what][0] == "CorruptionError" and "the data of step 6" in results[what][1], results[what]
    assert results["history 6"] == ["ok", "([], 0)"]  # its index rows hold no tensor to read
    assert results["cli verify"] == ["ok", "1"]  # exit 1: step 6 is damaged

    assert results["repair"][0] == "ok" and "000000000006.h5" in results["repair"][1]
    # the real command line, as a separate process
    out = subprocess.run([sys.executable, "-m", "datastates_hist.cli", "show", run_dir, "5"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "model/weight" in out.stdout, out.stderr
    assert not marker.exists()

    # a writer opening the run, then restoring: the bytes come back as bytes, never as objects
    model = torch.nn.Linear(4, 3)
    with dh.Checkpointer(run_dir) as ckpt:
        r = ckpt.restore(1, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(dh.StepNotFoundError):  # repair set the damaged step 6 aside
            ckpt.restore(6, model=model)
    assert bytes(r.extra["blob"].numpy()) == blob and r.extra["cfg"]["payload"] == blob
    assert r.extra["cfg"]["py/reduce"] == [{"py/function": "builtins.exec"}]
    assert not marker.exists()
