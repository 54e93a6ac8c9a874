"""Step files of the HDF5 backend are plain HDF5 that standard tools read."""

import os
import shutil
import subprocess

import h5py
import pytest
import torch

import datastates_hist as dh


def test_h5dump_lists_datasets_and_the_real_dtype_where_hdf5_has_none(run_dir):
    if shutil.which("h5dump") is None:
        pytest.skip("h5dump (Debian's hdf5-tools) is not installed; tools/install.sh installs it")
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    with dh.Checkpointer(run_dir, backend="hdf5") as ckpt:
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
