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


def _box(start, count) -> tuple:
    return tuple(slice(s, s + c) for s, c in zip(start, count))


class HDF5StepWriter(StagedStepWriter):
    def __init__(self, final: str, step: int):
        super().__init__(final)
        self.step = step
        self.file = h5py.File(self.tmp, "w", libver="latest")
        self.file.attrs["step"] = step

    def define(self, name, dtype, shape, real_dtype, block=None):
        ds = self.file.create_dataset(name, shape=tuple(shape), dtype=np.dtype(dtype))
        ds.attrs["name"] = name
        ds.attrs["dtype"] = real_dtype
        ds.attrs["step"] = self.step

    def put(self, name, array, start):
        ds = self.file[name]
        if array.size == 0:
            return
        if ds.shape == ():
            ds.write_direct(array.reshape(()))
        else:
            ds.write_direct(array, dest_sel=_box(start, array.shape))

    def write_out(self):
        pass  # puts are written at once

    def write_manifest(self, manifest: bytes) -> None:
        self.file.create_dataset(MANIFEST, data=np.frombuffer(manifest, dtype=np.uint8))

    def close_files(self):
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
