"""Step files of the HDF5 backend are plain HDF5 that standard tools read."""

import glob
import json
import os
import shutil
import subprocess

import h5py
import numpy as np
import pytest
import torch

import datastates_hist as dh
from datastates_hist.codecs import decode
from restoring import assert_step_restores


def need_h5dump():
    if shutil.which("h5dump") is None:
        pytest.skip("h5dump (Debian's hdf5-tools) is not installed; tools/install.sh installs it")


def test_h5dump_lists_datasets_and_the_real_dtype_where_hdf5_has_none(run_dir):
    need_h5dump()
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    with dh.Checkpointer(run_dir, backend="hdf5", codec="raw") as ckpt:
        ckpt.write(7, model, scale=torch.ones(2))
    (name,) = os.listdir(os.path.join(run_dir, "steps"))
    path = os.path.join(run_dir, "steps", name)
    assert name == "000000000007.h5"
    out = subprocess.run(["h5dump", "-H", path], capture_output=True, text=True, check=True).stdout
    assert 'GROUP "model"' in out and 'DATASET "weight"' in out
    assert "H5T_STD_U16LE" in out and "DATASPACE  SIMPLE { ( 3, 4 ) / ( 3, 4 ) }" in out
    out = subprocess.run(["h5dump", "-a", "/model/weight/dtype", path], capture_output=True,
                         text=True, check=True).stdout
    assert '"bfloat16"' in out
    with h5py.File(path, "r") as f:
        ds = f["model/weight"]
        assert dict(ds.attrs) == {"dtype": "bfloat16"} and f.attrs["step"] == 7
        # a dtype HDF5 has is stored as itself, without an attribute
        assert f["extra/scale"].dtype == "float32" and dict(f["extra/scale"].attrs) == {}
        raw = torch.from_numpy(ds[()]).view(torch.bfloat16)
        assert torch.equal(raw, model.weight)


def test_an_encoded_tensor_is_a_uint8_dataset_of_its_blob_that_the_manifest_decodes(run_dir):
    """Encoded (docs/format.md section 6): the blob under the tensor's name, a plain 1-D
    uint8 dataset without attributes; its manifest record's chunk table decodes it."""
    need_h5dump()
    model = torch.nn.Linear(64, 32).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.copy_(torch.arange(64 * 32).reshape(32, 64) % 7)  # compresses
    with dh.Checkpointer(run_dir, backend="hdf5", codec="key") as ckpt:
        ckpt.write(7, model)
    (name,) = os.listdir(os.path.join(run_dir, "steps"))
    path = os.path.join(run_dir, "steps", name)
    with h5py.File(path, "r") as f:
        blob = f["model/weight"][()]
        assert blob.dtype == np.uint8 and blob.ndim == 1 and dict(f["model/weight"].attrs) == {}
        doc = json.loads(f["__manifest__"][()].tobytes())
    rec = next(r for r in doc["tensors"] if r["name"] == "model/weight")
    assert (rec["encoding"], rec["dtype"], rec["shape"], rec["nbytes"], rec["stored"]) == (
        "key", "bfloat16", [32, 64], 4096, blob.size)
    assert blob.size < 4096 / 4
    out = subprocess.run(["h5dump", "-H", "-d", "/model/weight", path], capture_output=True, text=True,
                         check=True).stdout
    assert "H5T_STD_U8LE" in out and f"DATASPACE  SIMPLE {{ ( {blob.size} ) / ( {blob.size} ) }}" in out
    decoded = np.empty(rec["nbytes"], np.uint8)
    decode(blob, rec["chunks"], 2, decoded)
    assert torch.equal(torch.from_numpy(decoded).view(torch.bfloat16).reshape(32, 64), model.weight)


def test_datasets_another_tool_rewrote_read_back_the_same(run_dir):
    """A contiguous dataset of the memory's own type is read as a byte range of the file;
    one that h5repack or h5py rewrote (big-endian, chunked and gzip-compressed) is read
    through HDF5, which converts it: both restore bit-exact, checksums verified."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 1024))  # 6 MiB
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 512)).sum().backward()
    opt.step()
    with dh.Checkpointer(run_dir, backend="hdf5", codec="raw") as ckpt:
        ckpt.write(3, model, opt)
    path = os.path.join(run_dir, "steps", "000000000003.h5")
    with h5py.File(path, "r+") as f:
        for name, kwargs in (("model/0.weight", {"dtype": ">f4"}),
                             ("model/1.weight", {"chunks": (64, 1024), "compression": "gzip"}),
                             ("optim/state/1.weight/exp_avg", {"dtype": ">f4", "chunks": (128, 1024),
                                                        "compression": "gzip"})):
            data = f[name][()]
            del f[name]
            f.create_dataset(name, data=data, **kwargs)
        assert f["model/0.weight"].dtype == np.dtype(">f4") and f["model/1.weight"].compression == "gzip"
        assert f["model/0.bias"].id.get_offset() is not None  # still read as a byte range
    fresh = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 1024))
    fresh_opt = torch.optim.Adam(fresh.parameters())
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.restore(3, model=fresh, optimizer=fresh_opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
    for p, q in zip(opt.state.values(), fresh_opt.state.values()):
        assert all(torch.equal(p[k], q[k]) for k in ("exp_avg", "exp_avg_sq"))


def test_a_reader_reads_the_file_it_opened_and_closes_it_once(run_dir):
    """The byte ranges come from the file HDF5 opened, even if a newer file has taken
    its path since; a second close() closes nothing (the fd may belong to another file)."""
    from datastates_hist.backends.hdf5 import HDF5StepReader

    model = torch.nn.Linear(64, 32)
    with dh.Checkpointer(run_dir, backend="hdf5", codec="raw") as ckpt:
        ckpt.write(1, model)
    path = os.path.join(run_dir, "steps", "000000000001.h5")
    reader = HDF5StepReader(path)
    replaced = path + ".new"
    shutil.copy(path, replaced)
    with h5py.File(replaced, "r+") as f:
        f["model/weight"][...] = 0
    os.replace(replaced, path)
    out = np.empty((32, 64), np.float32)
    reader.read_many([("model/weight", out, (0, 0))])
    assert torch.equal(torch.from_numpy(out), model.weight.detach())
    reader.close()
    other = os.open(path, os.O_RDONLY)  # likely the number the reader had
    try:
        reader.close()
        assert os.fstat(other).st_size == os.path.getsize(path)
    finally:
        os.close(other)


def test_a_restore_decodes_the_blobs_from_the_mapped_file(run_dir):
    """An encoded step's blobs are views of the step file mapped read-only (none is read
    into memory first); a blob another tool rewrote (chunked, gzip) is read through h5py;
    both restore bit-exact. A blob of another size than asked for is left to ``read_many``."""
    from datastates_hist.backends.hdf5 import HDF5StepReader

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
    with dh.Checkpointer(run_dir, backend="hdf5", codec="key") as ckpt:
        ckpt.write(3, model)
    path = os.path.join(run_dir, "steps", "000000000003.h5")
    with h5py.File(path, "r+") as f:
        data = f["model/1.weight"][()]
        del f["model/1.weight"]
        f.create_dataset("model/1.weight", data=data, chunks=(1024,), compression="gzip")
        del f["__locations__"]  # as files written before the table: HDF5 says where each blob lies
    read_many, read = HDF5StepReader.read_many, []
    def recording(self, requests):
        read.extend(name for name, _, _ in requests)
        return read_many(self, requests)
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
    HDF5StepReader.read_many = recording
    try:
        with dh.Checkpointer(run_dir) as ckpt:
            ckpt.restore(3, model=fresh)
    finally:
        HDF5StepReader.read_many = read_many
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
    assert [name for name in read if name.startswith("model/")] == ["model/1.weight"]
    reader = HDF5StepReader(path)
    try:
        size = reader.file["model/0.weight"].shape[0]
        assert list(reader.mapped_bytes([("model/0.weight", size)])) == ["model/0.weight"]
        assert reader.mapped_bytes([("model/0.weight", size + 1), ("model/1.weight", 64)]) == {}
    finally:
        reader.close()


def _adam_step(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 32))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    return model, opt


def _locations(path):
    with h5py.File(path, "r") as f:
        return json.loads(f["__locations__"][()].tobytes())


@pytest.mark.parametrize("codec", ["raw", "key"])
def test_a_step_file_lists_where_each_dataset_lies(run_dir, codec):
    """``__locations__`` (docs/format.md section 3): every dataset's byte range and numpy
    dtype, as HDF5 itself reports them."""
    model, opt = _adam_step()
    with dh.Checkpointer(run_dir, backend="hdf5", codec=codec) as ckpt:
        ckpt.write(3, model, opt)
    path = os.path.join(run_dir, "steps", "000000000003.h5")
    table = _locations(path)
    with h5py.File(path, "r") as f:
        names = []
        f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        names = sorted(set(names) - {"__manifest__", "__locations__"})
        assert sorted(table) == names and len(names) > 10
        for name in names:
            ds = f[name]
            assert table[name] == [ds.id.get_offset(), ds.id.get_storage_size(), ds.dtype.str], name
    with open(path, "rb") as file:  # the range holds the dataset's bytes
        with h5py.File(path, "r") as f:
            offset, nbytes, dtype = table["model/0.weight"]
            file.seek(offset)
            assert file.read(nbytes) == f["model/0.weight"][()].astype(dtype).tobytes()


@pytest.mark.parametrize("codec", ["raw", "key"])
def test_a_restore_reads_by_the_table_without_opening_the_datasets(run_dir, codec):
    """A restore opens the manifest and the table through HDF5, and no tensor's dataset."""
    from datastates_hist.backends import hdf5

    model, opt = _adam_step()
    with dh.Checkpointer(run_dir, backend="hdf5", codec=codec) as ckpt:
        ckpt.write(3, model, opt)
    opened, open_dataset = [], hdf5.h5py.h5d.open
    def recording(loc, name, *args, **kwargs):
        opened.append(name.decode())
        return open_dataset(loc, name, *args, **kwargs)
    hdf5.h5py.h5d.open = recording
    try:
        assert_step_restores(run_dir, 3, model, opt)
    finally:
        hdf5.h5py.h5d.open = open_dataset
    assert sorted(set(opened)) == ["__locations__", "__manifest__"]


@pytest.mark.parametrize("codec", ["raw", "key"])
def test_a_table_gone_stale_after_another_tool_rewrote_a_dataset_still_restores(run_dir, codec):
    """Another tool rewrote a dataset elsewhere in the file (big-endian, chunked) and
    other bytes took its old range: the table's range fails the checksum, and the tensor
    is read again through HDF5: restored bit-exact, read bit-exact."""
    model, opt = _adam_step()
    with dh.Checkpointer(run_dir, backend="hdf5", codec=codec) as ckpt:
        ckpt.write(3, model, opt)
    path = os.path.join(run_dir, "steps", "000000000003.h5")
    table = _locations(path)
    rewritten = ("model/0.weight", "optim/state/1.weight/exp_avg_sq")
    with h5py.File(path, "r+") as f:
        for i, name in enumerate(rewritten):
            data = f[name][()]
            f.move(name, f"moved{i}")  # its old range, kept by the moved dataset, is then overwritten
            f.create_dataset(name, data=data, dtype=data.dtype.newbyteorder(">") if codec == "raw" else None,
                             chunks=True, compression="gzip")
            f[f"moved{i}"][...] = 90
            assert f[f"moved{i}"].id.get_offset() == table[name][0]
    assert _locations(path) == table  # stale
    assert_step_restores(run_dir, 3, model, opt)
    with dh.open(run_dir) as h:
        assert torch.equal(h.read("model/0.weight", 3), model[0].weight.detach())


def test_a_crafted_table_is_never_read_outside_the_file_nor_trusted(run_dir):
    """Entries outside the file, of another size or type, malformed, or pointing at
    another tensor's bytes: each restore is bit-exact (HDF5 is asked, or the bytes fail
    their checksum and are read again). Damage of the data itself is still named."""
    model, opt = _adam_step()
    with dh.Checkpointer(run_dir, backend="hdf5", codec="raw") as ckpt:
        ckpt.write(3, model, opt)
    path = os.path.join(run_dir, "steps", "000000000003.h5")
    table = _locations(path)
    size = os.path.getsize(path)
    w, b = table["model/0.weight"], table["model/0.bias"]
    other = table["optim/state/0.weight/exp_avg"]  # the same size and dtype as model/0.weight
    crafted = [
        {**table, "model/0.weight": [size - 4, w[1], w[2]], "model/0.bias": [-1, b[1], b[2]]},
        {**table, "model/0.weight": [True, w[1], w[2]], "model/0.bias": [b[0], b[1] + 4, b[2]]},
        {**table, "model/0.weight": [w[0], w[1], ">f4"], "model/0.bias": "x", "model/1.bias": [[1], 2]},
        {**table, "model/0.weight": other, "optim/state/0.weight/exp_avg": w},
        [1, 2, 3],
        b"{not json",
    ]
    for case in crafted:
        data = case if isinstance(case, bytes) else json.dumps(case).encode()
        with h5py.File(path, "r+") as f:
            del f["__locations__"]
            f.create_dataset("__locations__", data=np.frombuffer(data, np.uint8))
        assert_step_restores(run_dir, 3, model, opt)
    # a table that cannot be read as one: HDF5 is asked where each dataset lies
    good = json.dumps(table).encode()
    for make in (lambda f: f.create_group("__locations__"),
                 lambda f: f.create_dataset("__locations__", data=good.decode()),  # a string
                 lambda f: f.create_dataset("__locations__", data=np.frombuffer(good, np.uint8).astype(np.float32)),
                 lambda f: f.create_dataset("__locations__", data=np.frombuffer(good, np.uint8), chunks=(16,))):
        with h5py.File(path, "r+") as f:
            del f["__locations__"]
            make(f)
        assert_step_restores(run_dir, 3, model, opt)
    with h5py.File(path, "r+", libver="latest") as f:  # its header damaged (a version 2 header: checksummed)
        del f["__locations__"]
        f.create_dataset("__locations__", data=np.frombuffer(good, np.uint8))
        header = h5py.h5o.get_info(f["__locations__"].id)
        at = header.addr + header.hdr.space.total // 2
    with open(path, "r+b") as file:
        file.seek(at)
        byte = file.read(1)
        file.seek(at)
        file.write(bytes([byte[0] ^ 0x10]))
    with h5py.File(path, "r") as f, pytest.raises(KeyError, match="incorrect metadata checksum"):
        f["__locations__"]
    assert_step_restores(run_dir, 3, model, opt)
    with h5py.File(path, "r") as f:
        offset = f["model/0.weight"].id.get_offset()
    with open(path, "r+b") as file:
        file.seek(offset + 8)
        file.write(b"\xff" * 4)
    with pytest.raises(dh.CorruptionError, match=r"tensor 'model/0.weight' of step 3 .* does not match its checksum"):
        assert_step_restores(run_dir, 3, model, opt)


def test_a_table_pointing_every_range_elsewhere_still_restores_rounded_tensors_exactly(run_dir):
    """A restore point whose weights are rounded (keep_bits) keeps their low bits in its
    restore unit: with every entry of both units' tables moved to the file's first bytes,
    each tensor and each tensor's low bits fail their checksum and are read again."""
    model, opt = _adam_step()
    with dh.Checkpointer(run_dir, backend="hdf5", keep=dh.KeepLast(2),
                         trajectory=dh.Trajectory("model/*", every=1, keep_bits=8)) as ckpt:
        for step in range(3):
            model(torch.ones(2, 64)).sum().backward()
            opt.step()
            ckpt.write(step, model, opt)
    with dh.open(run_dir) as h:
        assert h.restore_points == [1, 2]
    units = sorted(glob.glob(os.path.join(run_dir, "steps", "000000000002*.h5")))
    assert [os.path.basename(u) for u in units] == ["000000000002.h5", "000000000002.restore.h5"]
    for path in units:
        moved = {name: [0, nbytes, dtype] for name, (_, nbytes, dtype) in _locations(path).items()}
        with h5py.File(path, "r+") as f:
            del f["__locations__"]
            f.create_dataset("__locations__", data=np.frombuffer(json.dumps(moved).encode(), np.uint8))
    assert_step_restores(run_dir, 2, model, opt)
