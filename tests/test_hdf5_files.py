"""Step files of the HDF5 backend are plain HDF5 that standard tools read."""

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
