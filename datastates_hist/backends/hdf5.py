"""HDF5 backend (h5py): one plain HDF5 file per step.

Each tensor is a contiguous dataset at its item name (``model/blocks.0.weight``
is dataset ``blocks.0.weight`` in group ``model``), with attributes ``dtype``
(the real torch dtype: bfloat16 is stored as uint16), ``name`` and ``step``,
so ``h5dump -H`` and h5py show what each dataset is. The manifest is the uint8
dataset ``__manifest__``. A file per step lets retention delete a step without
rewriting others, and lets readers open committed steps while the writer
appends new files. h5py releases the GIL inside its reads and writes.
"""

from __future__ import annotations

import os

import h5py
import numpy as np

from .base import Backend, StagedStepWriter, StepReader

MANIFEST = "__manifest__"
SUFFIX = ".h5"


_LINK_CREATE = h5py.h5p.create(h5py.h5p.LINK_CREATE)
_LINK_CREATE.set_create_intermediate_group(True)  # "model/fc1.weight": group model, dataset fc1.weight
_LINK_CREATE.set_char_encoding(h5py.h5t.CSET_UTF8)
_STRING = h5py.string_dtype("utf-8")


def _attribute(dsid, key: str, value) -> None:
    """A scalar attribute as h5py writes one (strings: variable-length UTF-8)."""
    data = np.array(value, dtype=_STRING) if isinstance(value, str) else np.asarray(value)
    attr = h5py.h5a.create(dsid, key.encode(), h5py.h5t.py_create(data.dtype, logical=True),
                           h5py.h5s.create(h5py.h5s.SCALAR))
    attr.write(data)


def _box(start, count) -> tuple:
    return tuple(slice(s, s + c) for s, c in zip(start, count))


class HDF5StepWriter(StagedStepWriter):
    """Datasets and attributes through h5py's low-level API: the high-level one
    costs about 1 ms per tensor, more than writing a small tensor
    (docs/performance.md); the files are the same."""

    def __init__(self, final: str, step: int):
        super().__init__(final)
        self.step = step
        self.file = h5py.File(self.tmp, "w", libver="latest")
        self.file.attrs["step"] = step
        self.datasets: dict[str, h5py.h5d.DatasetID] = {}

    def define(self, name, dtype, shape, real_dtype, block=None):
        shape = tuple(shape)
        space = h5py.h5s.create_simple(shape) if shape else h5py.h5s.create(h5py.h5s.SCALAR)
        dsid = h5py.h5d.create(self.file.id, name.encode(), h5py.h5t.py_create(np.dtype(dtype)), space,
                               lcpl=_LINK_CREATE)
        _attribute(dsid, "name", name)
        _attribute(dsid, "dtype", real_dtype)
        _attribute(dsid, "step", np.int64(self.step))
        self.datasets[name] = dsid

    def put(self, name, array, start):
        dsid = self.datasets[name]
        if array.size == 0:
            return
        if dsid.shape == () or (not any(start) and array.shape == dsid.shape):
            dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, array.reshape(dsid.shape))
            return
        file_space = dsid.get_space()
        file_space.select_hyperslab(tuple(start), tuple(array.shape))
        dsid.write(h5py.h5s.create_simple(tuple(array.shape)), file_space, array)

    def write_out(self):
        pass  # puts are written at once

    def write_manifest(self, manifest: bytes) -> None:
        self.file.create_dataset(MANIFEST, data=np.frombuffer(manifest, dtype=np.uint8))

    def close_files(self):
        self.datasets.clear()
        self.file.close()


class HDF5StepReader(StepReader):
    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"step data {path} is missing")
        self.file = h5py.File(path, "r")

    def manifest(self) -> bytes:
        return self.file[MANIFEST][()].tobytes()

    def read(self, name, out, start, part=None):
        ds = self.file[name]
        if out.size == 0:
            return
        if ds.shape == ():
            out[...] = ds[()]
        else:
            ds.read_direct(out, source_sel=_box(start, out.shape))

    def read_many(self, requests):
        """Whole datasets through h5py's low-level API: the high-level one costs
        about 0.3 ms per dataset, more than reading a small tensor."""
        for name, out, start in requests:
            if out.size == 0:
                continue
            dsid = h5py.h5d.open(self.file.id, name.encode())
            if dsid.shape != out.shape and not (dsid.shape == () and out.shape in ((), (1,))):
                raise ValueError(f"dataset {name} has shape {dsid.shape}, expected {out.shape}")
            dsid.read(h5py.h5s.ALL, h5py.h5s.ALL, out)

    def close(self):
        self.file.close()


class HDF5Backend(Backend):
    """Plain HDF5 files through h5py."""

    name = "hdf5"
    suffix = SUFFIX

    def writer_at(self, final, step):
        return HDF5StepWriter(final, step)

    def reader_at(self, path):
        return HDF5StepReader(path)
