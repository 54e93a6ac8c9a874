"""Paths and sizes read from a store are checked before anything is read, allocated or deleted.

A step's data is the one unit ``steps/<step>.<suffix>`` (or ``.ranks``) named by its
index row; a row naming anything else, or a unit that is a symbolic link, is refused
with :class:`CorruptionError` by every reader, by ``verify`` and by ``prune`` and
``truncate`` (which then change nothing). Tensor records declare shapes and sizes that
must agree with each other and with the bytes stored, so a crafted manifest fails
before memory is allocated for it. An empty index beside step data is damaged, for
readers and the writer alike.
"""

import json
import os
import shutil
import sqlite3
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist.backends import get_backend
from datastates_hist.backends.ranks import RankFilesWriter
from datastates_hist.codecs import GROUPED
from datastates_hist.commit import manifest_bytes, record_step
from datastates_hist.digest import checksum_bytes
from datastates_hist.dtypes import storage_torch_dtype
from datastates_hist.durable import remove_tree
from datastates_hist.group import Group
from datastates_hist.index import Index
from datastates_hist.items import TensorRecord
from datastates_hist.retention import remove_steps
from datastates_hist.store import Store
from datastates_hist.verify import verify_run

SUFFIX = {"adios2": ".bp", "hdf5": ".h5"}
STEPS = (1, 2, 3, 4)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "datastates_hist.cli", *args], capture_output=True, text=True)


def make_run(run_dir, backend, codec="delta"):
    """Steps 1..4 of a model whose weight changes at every step; with ``codec="delta"``,
    step 1 is stored as keys, step 2 as deltas against step 1, steps 3 and 4 as deltas
    against the two steps before them."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 4)  # weight: 512 bytes
    with dh.Checkpointer(run_dir, backend=backend, codec=codec) as ckpt:
        for step in STEPS:
            ckpt.wait_snapshot()
            with torch.no_grad():
                model.weight.add_(1)
            ckpt.write(step, model)
    return model


def assert_open_refused(run_dir, step, message):
    store = Store(run_dir)
    try:
        with pytest.raises(dh.CorruptionError) as caught:
            store.open_step(step)
        assert str(caught.value) == message
    finally:
        store.close()


def unit(step, backend):
    return f"{step:012d}{SUFFIX[backend]}"


def index_rows(run_dir):
    conn = sqlite3.connect(os.path.join(run_dir, "index.sqlite"))
    try:
        return (conn.execute("SELECT * FROM steps ORDER BY step").fetchall(),
                conn.execute("SELECT * FROM tensors ORDER BY step, name").fetchall())
    finally:
        conn.close()


def set_location(run_dir, step, location):
    conn = sqlite3.connect(os.path.join(run_dir, "index.sqlite"))
    with conn:
        conn.execute("UPDATE steps SET location=? WHERE step=?", (location, step))
    conn.close()


def location_message(run_dir, step, location, backend):
    steps = os.path.join(run_dir, "steps")
    return (f"the index row of step {step} in {run_dir} names {location!r} as the step's data, which must be "
            f"'{step:012d}{SUFFIX[backend]}' or '{step:012d}.ranks' in {steps}: the index is damaged "
            f"(rebuild it with: datastates-hist repair {run_dir})")


def symlink_message(run_dir, step, name):
    steps = os.path.join(run_dir, "steps")
    return (f"the data of step {step} in {run_dir} ({os.path.join(steps, name)}) is a symbolic link; "
            f"stored data is read and deleted only inside {steps}: refused")


def outside_dir(tmp_path):
    """A folder outside the run with a file in it that must survive."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sentinel").write_text("keep me")
    return outside


# --- locations ------------------------------------------------------------------------

def test_prune_refuses_an_absolute_location_and_changes_nothing(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
    outside = outside_dir(tmp_path)
    set_location(run_dir, 1, str(outside))
    before = index_rows(run_dir)
    listing = sorted(os.listdir(os.path.join(run_dir, "steps")))
    message = location_message(run_dir, 1, str(outside), backend)

    out = cli("prune", run_dir, "--keep-last", "2")
    assert (out.returncode, out.stderr.strip()) == (4, f"datastates-hist: {message}")
    # the writer refuses the run: it would delete step 1's own unit as uncommitted
    with pytest.raises(dh.CorruptionError) as caught:
        dh.Checkpointer(run_dir)
    assert str(caught.value) == message
    index = Index(run_dir, create=True)
    try:  # pruning itself checks every row before it deletes any
        with pytest.raises(dh.CorruptionError) as caught:
            remove_steps(run_dir, index, [2, 1])
        assert str(caught.value) == message
    finally:
        index.close()

    assert (outside / "sentinel").read_text() == "keep me"
    assert index_rows(run_dir) == before  # no row of any step was deleted
    assert sorted(os.listdir(os.path.join(run_dir, "steps"))) == listing


@pytest.mark.parametrize("codec", ["raw", "delta"])
def test_a_location_outside_steps_is_reported_by_verify_and_refused_on_read(tmp_path, backend, codec):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend, codec)
    # an intact copy of the unit outside the run, reached by a relative path
    shutil.copytree(os.path.join(run_dir, "steps"), tmp_path / "x")
    crafted = f"../../x/{unit(1, backend)}"
    set_location(run_dir, 1, crafted)
    message = location_message(run_dir, 1, crafted, backend)

    problems = [(p.step, p.tensor, p.message) for p in verify_run(run_dir)]
    assert problems[0] == (1, None, f"its data cannot be opened: {message}")
    if codec == "raw":
        assert problems == problems[:1]
    else:  # every later tensor is decoded through step 1, which is refused, not read
        assert [(s, t) for s, t, _ in problems[1:]] == [(s, r.name) for s in STEPS[1:] for r in records(run_dir, s)]
        assert all(m.startswith("its delta base at step ") and m.endswith(f"cannot be read: {message}")
                   for _, _, m in problems[1:])
    out = cli("verify", run_dir, "--json")
    assert out.returncode == 1, out.stderr
    assert json.loads(out.stdout)["problems"] == [{"step": s, "tensor": t, "message": m} for s, t, m in problems]
    assert_open_refused(run_dir, 1, message)
    with pytest.raises(dh.CorruptionError, match="names '../../x/"):
        dh.open(run_dir).read("model/weight", 1)


def test_a_location_of_another_step_is_refused(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
    set_location(run_dir, 1, unit(2, backend))
    before = index_rows(run_dir)
    out = cli("prune", run_dir, "--keep-last", "1")
    assert (out.returncode, out.stderr.strip()) == (
        4, "datastates-hist: " + location_message(run_dir, 1, unit(2, backend), backend))
    assert index_rows(run_dir) == before
    assert sorted(os.listdir(os.path.join(run_dir, "steps"))) == [unit(s, backend) for s in STEPS]


# --- symbolic links -------------------------------------------------------------------

def test_a_symlinked_unit_is_refused_on_read_and_on_prune_and_its_target_kept(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend, codec="raw")  # raw: no later step is encoded against step 1, prune takes it
    name = unit(1, backend)
    weight = dh.open(run_dir).read("model/weight", 1)
    link = os.path.join(run_dir, "steps", name)
    target = str(tmp_path / name)
    os.rename(link, target)
    os.symlink(target, link)
    before = index_rows(run_dir)
    message = symlink_message(run_dir, 1, name)

    assert_open_refused(run_dir, 1, message)
    out = cli("prune", run_dir, "--keep-last", "2")
    assert out.returncode == 4 and out.stderr.strip() == f"datastates-hist: {message}", out
    assert index_rows(run_dir) == before
    assert os.path.islink(link) and os.path.exists(target)
    os.remove(link)  # the unit moved back: the step reads again
    os.rename(target, link)
    assert torch.equal(dh.open(run_dir).read("model/weight", 1), weight)


def test_an_uncommitted_symlink_in_steps_is_removed_without_following_it(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
    outside = outside_dir(tmp_path)
    link = os.path.join(run_dir, "steps", unit(99, backend))
    os.symlink(outside, link)
    with dh.Checkpointer(run_dir) as ckpt:  # the writer removes what no row names
        assert ckpt.steps() == list(STEPS)
    assert not os.path.lexists(link)
    assert (outside / "sentinel").read_text() == "keep me"


def test_remove_tree_removes_a_link_not_its_target(tmp_path):
    outside = outside_dir(tmp_path)
    for name in ("to-dir", "to-file"):
        os.symlink(outside if name == "to-dir" else outside / "sentinel", tmp_path / name)
        remove_tree(str(tmp_path / name))
        assert not os.path.lexists(tmp_path / name)
    assert (outside / "sentinel").read_text() == "keep me"


def write_ranks_step(run_dir, backend, step, tensor):
    """A real one-rank ``.ranks`` unit of ``step`` holding ``tensor`` as the block of rank 0."""
    array = tensor.numpy()
    checksum = checksum_bytes(array.reshape(-1).view(np.uint8))
    writer = RankFilesWriter(get_backend(backend), os.path.join(run_dir, "steps"), step, Group())
    writer.define("w", array.dtype, array.shape, "float32")
    writer.put("w", array, (0, 0))
    record = TensorRecord("w", "float32", tuple(array.shape), array.nbytes, checksum,
                          blocks=[{"start": [0, 0], "count": list(array.shape), "checksum": checksum, "part": 0}])
    manifest = manifest_bytes(step, [record], {"items": {}, "objects": {}}, world_size=1)
    writer.seal(manifest)
    location = writer.publish()
    index = Index(run_dir, create=True)
    try:
        record_step(index, backend, step, location, [record], manifest)
    finally:
        index.close()
    return location


def test_a_symlinked_rank_file_inside_a_ranks_unit_is_refused(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    location = write_ranks_step(run_dir, backend, 5, tensor)
    assert location == "000000000005.ranks"
    assert torch.equal(dh.open(run_dir).read("w", 5), tensor)  # the real unit reads back
    rank_file = os.path.join(run_dir, "steps", location, f"rank00000{SUFFIX[backend]}")
    target = str(tmp_path / "rank-file-elsewhere")
    os.rename(rank_file, target)
    os.symlink(target, rank_file)
    store = Store(run_dir)
    try:
        with pytest.raises(dh.CorruptionError, match=(
                rf"the manifest of step 5 in {run_dir} cannot be read: the step's data is damaged \(the file "
                rf"of rank 0 \({rank_file}\) is a symbolic link; stored data is read and deleted only inside "
                rf"{os.path.join(run_dir, 'steps', location)}: refused\)")):
            store.open_step(5)
    finally:
        store.close()
    assert os.path.exists(target)


# --- declared sizes -------------------------------------------------------------------

def stored_arrays(data):
    """name -> what the step's unit holds for each tensor: its array (raw), or its blob (encoded)."""
    arrays = {}
    for rec in data.records.values():
        if rec.encoding == "raw":
            t = data.read(rec.name)
            arrays[rec.name] = t.view(storage_torch_dtype(t.dtype)).numpy()
        else:
            arrays[rec.name] = np.empty(rec.stored, np.uint8)
            data.readers[rec.part].read(rec.name, arrays[rec.name], (0,))
    return arrays


def rewrite_manifest(run_dir, step, edit):
    """Write ``step``'s unit again with its backend's own writer, its tensors as they
    are stored (raw, or their blobs) and its manifest changed by ``edit(doc)``; the
    index row takes the new manifest's checksum, as a crafted store would."""
    store = Store(run_dir)
    try:
        row = store.row(step)
        with store.open_step(step) as data:
            doc = json.loads(data.reader.manifest())
            arrays = stored_arrays(data)
    finally:
        store.close()
    backend = get_backend(row.backend)
    remove_tree(os.path.join(run_dir, "steps", row.location))
    writer = backend.begin_step(os.path.join(run_dir, "steps"), step)
    for rec in doc["tensors"]:
        array = np.ascontiguousarray(arrays[rec["name"]])
        writer.define(rec["name"], array.dtype, array.shape, rec["dtype"] if rec["encoding"] == "raw" else "uint8")
        writer.put(rec["name"], array, (0,) * array.ndim)
    edit(doc)
    manifest = json.dumps(doc, separators=(",", ":")).encode()
    location = writer.finish(manifest)
    conn = sqlite3.connect(os.path.join(run_dir, "index.sqlite"))
    with conn:
        conn.execute("UPDATE steps SET manifest_checksum=?, location=? WHERE step=?",
                     (checksum_bytes(manifest), location, step))
    conn.close()


def records(run_dir, step):
    store = Store(run_dir)
    try:
        return store.records(step)
    finally:
        store.close()


def weight_record(doc):
    return next(r for r in doc["tensors"] if r["name"] == "model/weight")


def crafted(**fields):
    def edit(doc):
        weight_record(doc).update(fields)
    return edit


def restore_not_strict(run_dir, step):
    with dh.Checkpointer(run_dir) as ckpt:
        return ckpt.restore(step, model=torch.nn.Linear(32, 4), strict=False)


@pytest.mark.parametrize("fields, says", [
    ({"shape": [2 ** 31, 2 ** 31]},
     "tensor 'model/weight' has the shape [2147483648, 2147483648] of 4-byte elements: its nonzero dimensions "
     "span more than 2**63-1 bytes, more than an array can address"),
    ({"shape": [2 ** 27, 4]},
     "tensor 'model/weight' declares shape [134217728, 4] of float32, which is 2147483648 bytes, "
     "but records 512 bytes"),
    ({"shape": [-4, -32]},
     "tensor 'model/weight' has shape [-4, -32]: each dimension must be an integer from 0 to 2**63-1"),
    ({"shape": [4.0, 32]},
     "tensor 'model/weight' has shape [4.0, 32]: each dimension must be an integer from 0 to 2**63-1"),
    ({"shape": [2 ** 64, 0]},
     "tensor 'model/weight' has shape [18446744073709551616, 0]: each dimension must be an integer "
     "from 0 to 2**63-1"),
    ({"shape": [0, 2 ** 62], "nbytes": 0},
     "tensor 'model/weight' has the shape [0, 4611686018427387904] of 4-byte elements: its nonzero dimensions "
     "span more than 2**63-1 bytes, more than an array can address"),
    ({"shape": "4x32"},
     "tensor 'model/weight' has shape '4x32': each dimension must be an integer from 0 to 2**63-1"),
    ({"nbytes": "512"},
     "tensor 'model/weight' declares shape [4, 32] of float32, which is 512 bytes, but records '512' bytes"),
    ({"dtype": "float99"}, "tensor 'model/weight' has an unknown dtype 'float99'"),
    ({"blocks": [{"start": [0, 0], "count": [8, 32], "checksum": "", "part": None}]},
     "tensor 'model/weight' has a malformed block: {'start': [0, 0], 'count': [8, 32], 'checksum': '', "
     "'part': None}"),
    ({"blocks": [{"start": [0, 0], "count": [2, 32], "checksum": "0" * 16, "part": None}]},
     "tensor 'model/weight' of shape [4, 32]: 64 of its 128 elements are in its blocks"),
    ({"blocks": [{"start": [0, 0], "count": [2, 32], "checksum": "0" * 16, "part": None}] * 2},
     "tensor 'model/weight' of shape [4, 32]: its blocks at [0, 0] and [0, 0] overlap"),
    ({"blocks": [{"start": [0, 0], "count": [4, 32], "checksum": "", "part": None}]},
     "tensor 'model/weight' has a malformed block: {'start': [0, 0], 'count': [4, 32], 'checksum': '', "
     "'part': None}"),
    ({"encoding": "zstd"},
     "tensor 'model/weight' has the encoding 'zstd', which this version does not read (it reads raw, key, delta)"),
    ({"encoding": "delta"}, "tensor 'model/weight' is encoded but records None stored bytes"),
])
def test_crafted_records_are_refused_before_anything_is_allocated(tmp_path, backend, fields, says):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend, codec="raw")
    rewrite_manifest(run_dir, 2, crafted(**fields))
    with pytest.raises(dh.CorruptionError) as caught:
        restore_not_strict(run_dir, 2)
    assert str(caught.value) == f"the manifest of step 2 in {run_dir} is damaged: {says}"
    problems = verify_run(run_dir)
    assert [(p.step, p.tensor) for p in problems] == [(2, None)]
    assert problems[0].message.endswith(says)


# Step 3 of an encoded run: model/weight is a delta against steps 2 and 1, its blob of
# S bytes one compressed chunk; step 4 is a delta against it. Each case: the record's
# fields from the stored record ``r``, and what the refusal says (S: the blob's bytes).
IN_WEIGHT = "tensor 'model/weight': "  # what a chunk table's refusal begins with
ENCODED_MANIFEST_CASES = [
    (lambda r: {"chunks": [[512, r["stored"], 1]]}, IN_WEIGHT + "chunk 0: stored raw but stored_len {S} != raw_len 512"),
    (lambda r: {"chunks": [[512, r["stored"] - 1, 0]]}, IN_WEIGHT + "chunk table stores {S-1} bytes, the blob has {S}"),
    (lambda r: {"chunks": [[256, r["stored"], 0]]}, IN_WEIGHT + "chunk 0: compressed stored_len {S} is impossible for raw_len 256"),
    (lambda r: {"chunks": [[2 ** 40, r["stored"], 0]]},
     IN_WEIGHT + "chunk 0: raw_len 1099511627776 exceeds the chunk size 4194304"),
    (lambda r: {"chunks": [[512, r["stored"], 0]] * 2}, IN_WEIGHT + "chunk table covers 1024 bytes, the tensor has 512"),
    (lambda r: {"chunks": str(r["chunks"])}, IN_WEIGHT + "chunk table must be a list, got str"),
    (lambda r: {"chunks": [[512, r["stored"]]]}, IN_WEIGHT + "chunk 0: entry must be 3 integers [raw_len, stored_len, flag], "
                                                 "got [512, {S}]"),
    (lambda r: {"shape": [2 ** 27, 4], "nbytes": 2 ** 31},
     IN_WEIGHT + "chunk table covers 512 bytes, the tensor has 2147483648"),
    (lambda r: {"stored": None}, "tensor 'model/weight' is encoded but records None stored bytes"),
    (lambda r: {"base": None}, "tensor 'model/weight' has the encoding 'delta' and the base None: a delta needs "
                               "the step it is encoded against, a key none"),
    (lambda r: {"encoding": "key", "base": None},
     "tensor 'model/weight' has the bases None and 1: a second base must be a step before the first"),
    (lambda r: {"base2": 3}, "tensor 'model/weight' has the bases 2 and 3: a second base must be a step before "
                             "the first"),
    (lambda r: {"base": -2, "base2": None}, "tensor 'model/weight' has the encoding 'delta' and the base -2: a "
                                            "delta needs the step it is encoded against, a key none"),
]


def deltas_against(run_dir, step, base):
    """The tensors of ``step`` stored as deltas against ``base``, in manifest order."""
    store = Store(run_dir)
    try:
        names = [r.name for r in store.records(step) if r.base == base]
    finally:
        store.close()
    assert "model/weight" in names
    return names


def encoded_weight(run_dir, step):
    """The manifest record of model/weight at ``step`` (checked to be as the cases expect)."""
    store = Store(run_dir)
    try:
        with store.open_step(step) as data:
            rec = weight_record(json.loads(data.reader.manifest()))
    finally:
        store.close()
    assert (rec["encoding"], rec["base"], rec["base2"], len(rec["chunks"]), rec["chunks"][0][2]) == (
        "delta", 2, 1, 1, GROUPED) and 32 < rec["stored"] < 512, rec
    return rec


@pytest.mark.parametrize("case", range(len(ENCODED_MANIFEST_CASES)))
def test_crafted_encoded_records_are_refused_before_anything_is_allocated(tmp_path, backend, case):
    fields, says = ENCODED_MANIFEST_CASES[case]
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
    rec = encoded_weight(run_dir, 3)
    says = says.replace("{S-1}", str(rec["stored"] - 1)).replace("{S}", str(rec["stored"]))
    rewrite_manifest(run_dir, 3, crafted(**fields(rec)))
    with pytest.raises(dh.CorruptionError) as caught:
        restore_not_strict(run_dir, 3)
    assert str(caught.value) == f"the manifest of step 3 in {run_dir} is damaged: {says}"
    problems = verify_run(run_dir)
    # the tensors of step 4, deltas against step 3, cannot be decoded either, and say why
    assert [(p.step, p.tensor) for p in problems] == [(3, None)] + [(4, name) for name in deltas_against(run_dir, 4, 3)]
    assert problems[0].message.endswith(says)
    assert {p.message for p in problems[1:]} == {
        f"its delta base at step 3 cannot be read: the manifest of step 3 in {run_dir} is damaged: {says}"}


ENCODED_READ_CASES = [
    ({"base": 4}, "tensor 'model/weight' of step 3 in {run} is a delta against step 4, which is not earlier: "
                  "the step's data is damaged"),
    ({"base": 3}, "tensor 'model/weight' of step 3 in {run} is a delta against step 3, which is not earlier: "
                  "the step's data is damaged"),
    ({"base": 0, "base2": None}, "a delta of tensor 'model/weight' in {run} is against step 0, which is not "
                                 "committed: the run is damaged"),
    ({"chunks": "lie"}, "tensor 'model/weight' of step 3 in {run} cannot be decoded: chunk 0: its header says "
                        "512 bytes compressed to {S}, the chunk table 508 to {S-4}: the stored data is damaged"),
]


@pytest.mark.parametrize("fields, says", ENCODED_READ_CASES)
def test_a_crafted_delta_base_or_chunk_header_is_refused_when_the_tensor_is_read(tmp_path, backend, fields, says):
    """What a record alone cannot tell: its base is a later step, or one not committed;
    its chunk table disagrees with the chunks' own headers. Refused by name when the
    tensor is decoded, before its base is read or its chunks decompressed."""
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
    rec = encoded_weight(run_dir, 3)
    if fields == {"chunks": "lie"}:  # the same bytes, cut as two chunks
        fields = {"chunks": [[508, rec["stored"] - 4, 0], [4, 4, 1]]}
    says = says.replace("{run}", run_dir).replace("{S-4}", str(rec["stored"] - 4)).replace("{S}", str(rec["stored"]))
    rewrite_manifest(run_dir, 3, crafted(**fields))
    conn = sqlite3.connect(os.path.join(run_dir, "index.sqlite"))
    with conn:  # the index says what the crafted manifest says
        conn.execute("UPDATE tensors SET base=? WHERE step=3 AND name='model/weight'", (fields.get("base", 2),))
    conn.close()
    with pytest.raises(dh.CorruptionError) as caught:
        restore_not_strict(run_dir, 3)
    # a base that cannot be read is named by the delta that needs it
    assert str(caught.value) == (f"tensor 'model/weight' of step 3 in {run_dir} is a delta against step 0, "
                                 f"which cannot be read: {says}" if fields.get("base") == 0 else says)
    problems = verify_run(run_dir)
    assert [(p.step, p.tensor) for p in problems] == [(3, "model/weight"), (4, "model/weight")]
    # verify reads an earlier base first, and names it
    assert problems[0].message == (f"its delta base at step 0 cannot be read: {says}" if fields.get("base") == 0
                                   else says)
    assert problems[1].message == f"its delta base at step 3 cannot be read: {says}"


def test_sizes_larger_than_the_stored_bytes_fail_before_memory_is_asked_for(tmp_path, backend):
    """Shape and byte count agree, but are more than the unit holds (16 TiB here,
    more than this machine's memory): refused by name, no MemoryError or OverflowError."""
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend, codec="raw")
    rewrite_manifest(run_dir, 3, crafted(shape=[2 ** 40, 4], nbytes=2 ** 44))
    with pytest.raises(dh.CorruptionError) as caught:
        restore_not_strict(run_dir, 3)
    name = os.path.join(run_dir, "steps", unit(3, backend))
    stored = (os.path.getsize(name) if backend == "hdf5" else
              sum(os.path.getsize(os.path.join(name, f)) for f in os.listdir(name)))
    assert str(caught.value) == (f"the manifest of step 3 in {run_dir} is damaged: tensor 'model/weight' "
                                 f"declares {2 ** 44} bytes, more than the {stored} bytes of the step's data")


@pytest.mark.parametrize("codec", ["raw", "delta"])
def test_a_restore_of_a_crafted_size_stays_small_in_memory(tmp_path, backend, codec):
    """2 GiB declared for a 512-byte tensor (shape and bytes agreeing; encoded: a blob
    of 2 GiB in a chunk table that adds up): a non-strict restore in a fresh process
    fails by name and its peak memory stays far below 2 GiB."""
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend, codec)
    fields = {"shape": [2 ** 27, 4], "nbytes": 2 ** 31}
    if codec != "raw":
        fields.update(stored=2 ** 31, chunks=[[4 << 20, 4 << 20, 1]] * 512)
    rewrite_manifest(run_dir, 3, crafted(**fields))
    # VmHWM, the peak of this process's own memory: ru_maxrss of a child started from
    # the large test process counts the parent's resident memory at the exec
    script = (
        "import re, torch, datastates_hist as dh\n"
        "try:\n"
        f"    dh.Checkpointer({run_dir!r}).restore(3, model=torch.nn.Linear(32, 4), strict=False)\n"
        "except dh.CorruptionError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
        "kib = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())[1]\n"
        "print('peak', int(kib) * 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"CorruptionError the manifest of step 3 in {run_dir} is damaged: "
                               f"tensor 'model/weight' declares {2 ** 31} bytes, more than the "), lines
    assert int(lines[1].split()[1]) < 2 ** 30, lines


def test_an_index_row_of_a_crafted_shape_is_named(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
    conn = sqlite3.connect(os.path.join(run_dir, "index.sqlite"))
    with conn:
        conn.execute("UPDATE tensors SET shape='[134217728, 4]' WHERE step=2 AND name='model/weight'")
    conn.close()
    index = os.path.join(run_dir, "index.sqlite")
    with pytest.raises(dh.CorruptionError) as caught:
        dh.open(run_dir).tensors(2)
    assert str(caught.value) == (
        f"the index {index} is damaged: step 2: tensor 'model/weight' declares shape [134217728, 4] of "
        f"float32, which is 2147483648 bytes, but records 512 bytes (rebuild it from the step data with: "
        f"datastates-hist repair {run_dir})")
    problems = verify_run(run_dir)
    assert [(p.step, p.tensor) for p in problems] == [(2, None)] and "2147483648 bytes" in problems[0].message


def test_a_box_outside_the_tensor_is_refused_as_a_bad_request(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
    store = Store(run_dir)
    try:
        with store.open_step(1) as data:
            for start, count in (((0, 30), (4, 8)), ((-1, 0), (2, 2)), ((0, 0), (5, 1))):
                with pytest.raises(ValueError) as caught:
                    data.read_box("model/weight", start, count)
                assert str(caught.value) == (f"the box at {list(start)} of {list(count)} does not fit tensor "
                                             "'model/weight' of shape [4, 32]")
    finally:
        store.close()


# --- an empty index -------------------------------------------------------------------

def test_a_zero_length_index_beside_step_data_is_damaged_for_every_reader_and_the_writer(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, backend)
    index = os.path.join(run_dir, "index.sqlite")
    open(index, "wb").close()
    message = (f"the index {index} is damaged (it holds no tables) while {os.path.join(run_dir, 'steps')} "
               f"holds 4 step unit(s): it was lost; rebuild it from the step data with: "
               f"datastates-hist repair {run_dir}")
    for open_it in (lambda: Index(run_dir), lambda: Store(run_dir), lambda: dh.Checkpointer(run_dir),
                    lambda: verify_run(run_dir)):
        with pytest.raises(dh.CorruptionError) as caught:
            open_it()
        assert str(caught.value) == message
    out = cli("verify", run_dir)
    assert (out.returncode, out.stderr.strip()) == (4, f"datastates-hist: {message}")
    assert os.path.getsize(index) == 0  # nothing was written to it
    out = cli("repair", run_dir)
    assert out.returncode == 0, out.stderr
    assert dh.open(run_dir).steps == list(STEPS)


def test_a_zero_length_index_without_step_data_is_being_created_and_the_writer_creates_it(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    os.makedirs(os.path.join(run_dir, "steps"))
    open(os.path.join(run_dir, "index.sqlite"), "wb").close()  # a writer stopped right after creating it
    with pytest.raises(dh.StoreNotFoundError, match=r"has an empty index \(index.sqlite has no tables\) and no "
                                                    r"step data: a writer is creating it"):
        Store(run_dir)
    assert cli("verify", run_dir).returncode == 3
    model = torch.nn.Linear(4, 2)
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        ckpt.write(0, model)
    assert torch.equal(dh.open(run_dir).read("model/weight", 0), model.weight.detach())


def test_hdf5_data_stored_outside_the_file_is_refused(tmp_path):
    """External storage and links would read other files: refused, not read. (Without the
    file's table of locations, which lists the blob's old range in the file itself: read by
    it, a read gets this file's bytes or none, test_hdf5_files.py.)"""
    run_dir = str(tmp_path / "run")
    make_run(run_dir, "hdf5")
    outside = tmp_path / "outside.bin"
    np.arange(128, dtype=np.float32).tofile(outside)
    path = os.path.join(run_dir, "steps", unit(2, "hdf5"))
    with h5py.File(path, "r+") as f:
        del f["model/weight"]
        f.create_dataset("model/weight", shape=(4, 32), dtype=np.float32, external=[(str(outside), 0, 512)])
        del f["__locations__"]
    with dh.open(run_dir) as h, pytest.raises(dh.CorruptionError) as caught:
        h.read("model/weight", 2, index=(slice(0, 2),))  # a box read, which skips the checksum
    assert str(caught.value) == (f"tensor 'model/weight' of step 2 in {run_dir} cannot be read: dataset "
                                 f"'model/weight' of {path} stores its data outside the file")
    with h5py.File(path, "r+") as f:
        del f["model/weight"]
        f["model/weight"] = h5py.SoftLink("/model/bias")
    with dh.open(run_dir) as h, pytest.raises(dh.CorruptionError, match=(
            f"tensor .model/weight. of step 2 in {run_dir} cannot be read: {path} holds a soft link at .model/weight.; "
            "step files hold only their own datasets")):
        h.read("model/weight", 2)


def test_hdf5_external_storage_that_also_names_an_address_in_the_file_is_refused(tmp_path):
    """A crafted layout may name external storage and an address in this file at once:
    HDF5 then reports the address (as a contiguous dataset's) but reads the external file."""
    import struct

    from hdf5_headers import fix_header_checksum

    run_dir = str(tmp_path / "run")
    make_run(run_dir, "hdf5", codec="raw")
    outside = tmp_path / "outside.bin"
    np.full(128, 7, np.float32).tofile(outside)
    path = os.path.join(run_dir, "steps", unit(2, "hdf5"))
    with h5py.File(path, "r+", libver="latest") as f:  # a version 2 header: checksummed
        bias_at = f["model/bias"].id.get_offset()
        del f["model/weight"]
        f.create_dataset("model/weight", shape=(4, 32), dtype=np.float32, external=[(str(outside), 0, 512)])
        del f["__locations__"]  # HDF5 is asked where the bytes lie (the table would list the old range)
    data = bytearray(open(path, "rb").read())
    # the layout message, version 3, contiguous: an undefined address, then the size
    layout = b"\x03\x01" + b"\xff" * 8 + struct.pack("<Q", 512)
    assert data.count(layout) == 1
    at = data.find(layout)
    data[at + 2:at + 10] = struct.pack("<Q", bias_at)
    fix_header_checksum(data, at)
    open(path, "wb").write(bytes(data))
    with h5py.File(path, "r") as f:  # HDF5 takes it, and reads the outside file
        assert f["model/weight"].id.get_offset() == bias_at and (f["model/weight"][()] == 7).all()
    expected = (f"tensor 'model/weight' of step 2 in {run_dir} cannot be read: dataset 'model/weight' "
                f"of {path} stores its data outside the file")
    for read in (lambda h: h.read("model/weight", 2), lambda h: h.read("model/weight", 2, index=(slice(0, 2),))):
        with dh.open(run_dir) as h, pytest.raises(dh.CorruptionError) as caught:
            read(h)
        assert str(caught.value) == expected
    # a restore reads byte ranges of the file itself: the address's bytes, which the checksum
    # refuses; read again through HDF5, the layout is refused
    with dh.Checkpointer(run_dir) as ckpt, pytest.raises(dh.CorruptionError) as caught:
        ckpt.restore(2, model=torch.nn.Linear(32, 4))
    assert str(caught.value) == expected


def test_an_hdf5_manifest_declaring_more_than_its_file_stores_is_refused(tmp_path):
    run_dir = str(tmp_path / "run")
    make_run(run_dir, "hdf5")
    path = os.path.join(run_dir, "steps", unit(2, "hdf5"))
    with h5py.File(path, "r+") as f:  # 1 GiB declared, nothing stored: a read would allocate it
        del f["__manifest__"]
        f.create_dataset("__manifest__", shape=(2 ** 30,), dtype=np.uint8, chunks=(2 ** 20,))
    with dh.open(run_dir) as h, pytest.raises(dh.CorruptionError) as caught:
        h.read("model/weight", 2)
    assert str(caught.value) == (f"the manifest of step 2 in {run_dir} cannot be read: the step's data is "
                                 f"damaged (the manifest of {path} declares more bytes than the file stores for it)")


def test_crafted_optimizer_groups_are_named_as_damage(tmp_path, backend):
    run_dir = str(tmp_path / "run")
    model = torch.nn.Linear(32, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with dh.Checkpointer(run_dir, backend=backend) as ckpt:
        model(torch.ones(1, 32)).sum().backward()
        opt.step()
        ckpt.write(2, model, opt)

    def edit(doc):
        doc["values"]["items"]["optim/param_groups"] = {"type": "SGD", "groups": 5}
    rewrite_manifest(run_dir, 2, edit)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for strict in (True, False):
        with dh.Checkpointer(run_dir) as ckpt, pytest.raises(dh.CorruptionError) as caught:
            ckpt.restore(2, model=model, optimizer=opt, strict=strict)
        assert str(caught.value) == (
            f"the stored state of 'optim' in step 2 of {run_dir} is not what its provider wrote "
            "(TypeError: 'int' object is not iterable): the step's data is damaged")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing loaded
