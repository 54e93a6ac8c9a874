"""HDF5 backend (h5py): one plain HDF5 file per step.

Each tensor is a contiguous dataset at its item name (``model/blocks.0.weight``
is dataset ``blocks.0.weight`` in group ``model``) of its own type where HDF5
has one; the others (bfloat16, float16, bool, float8) are stored as unsigned
integers of the same width with the attribute ``dtype`` naming the real torch
dtype, so ``h5dump -H`` and h5py show what each dataset is. The root group's
attribute ``step`` is the step. The manifest is the uint8
dataset ``__manifest__``. A file per step lets retention delete a step without
rewriting others, and lets readers open committed steps while the writer
appends new files. h5py releases the GIL inside its reads and writes. The reader
reads a contiguous dataset of the memory's type as the byte range HDF5 reports for it
(``H5Dget_offset``), the other layouts through h5py.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import mmap
import os
import weakref
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np

from .base import Backend, StagedStepWriter
from .space import reserve_space, trim
from .step import StepReader

MANIFEST = "__manifest__"
# Where each contiguous dataset's bytes lie, written when the file is sealed: the reader
# of a whole step (a restore) reads its byte ranges without opening 309 datasets through
# h5py (48 us each for the small GPT: 15 ms of a 75 ms restore). An accelerator only:
# without it, or for a dataset it does not list as asked, the reader asks HDF5.
LOCATIONS = "__locations__"
LOCATIONS_BYTES = 64 << 20  # a larger table is not this writer's (about 80 bytes a tensor)
SUFFIX = ".h5"


_LINK_CREATE = h5py.h5p.create(h5py.h5p.LINK_CREATE)
_LINK_CREATE.set_create_intermediate_group(True)  # "model/fc1.weight": group model, dataset fc1.weight
_LINK_CREATE.set_char_encoding(h5py.h5t.CSET_UTF8)
_STRING = h5py.string_dtype("utf-8")


_STRING_TYPE = h5py.h5t.py_create(_STRING, logical=True)
_SCALAR = h5py.h5s.create(h5py.h5s.SCALAR)


def _string_attribute(dsid, key: bytes, value: str) -> None:
    """A scalar string attribute as h5py writes one (variable-length UTF-8)."""
    h5py.h5a.create(dsid, key, _STRING_TYPE, _SCALAR).write(np.array(value, dtype=_STRING))


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name  # numpy builds the name in Python: 6 us a tensor


@functools.lru_cache(maxsize=None)
def _file_type(dtype: np.dtype):
    return h5py.h5t.py_create(dtype)


DIRECT_THREADS_BYTES = 8 << 20  # a batch read by two threads from this size on
RESERVE_MARGIN = 64 << 10  # for the file's own metadata, at the start


def metadata_margin(name: str) -> int:
    """Space reserved for the metadata of dataset ``name``: its object header and link,
    and the groups its path creates. Measured (h5py 3.16, libver latest): 350-800 bytes
    for a flat or a nested name, 4.6 KB for a name that creates 30 groups; reserved
    here with 4-13x to spare (tests/test_disk_full.py holds each file within it).
    64 KiB each made a step of the small GPT allocate 20 MB for a 400 KB file: a raw
    checkpoint took 222-249 ms of CPU on tmpfs, 209-219 ms with this margin."""
    return 4096 + 512 * name.count("/") + 4 * len(name.encode())


def _writable(out: np.ndarray) -> bool:
    return out.flags.c_contiguous and out.flags.writeable


def _box(start, count) -> tuple:
    return tuple(slice(s, s + c) for s, c in zip(start, count))


class HDF5StepWriter(StagedStepWriter):
    """Datasets and attributes through h5py's low-level API: the high-level one
    costs about 1 ms per tensor, more than writing a small tensor
    (docs/performance.md); the files are the same. An attribute only where the
    stored type is not the real one: each costs about as much as the dataset."""

    def __init__(self, final: str, step: int):
        super().__init__(final)
        try:
            self.file = h5py.File(self.tmp, "w", libver="latest")
        except BaseException as exc:
            self.remove()  # a disk with no byte left: nothing of the step's is left behind
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:  # not HDF5's lines of detail
                raise OSError(errno.ENOSPC, f"cannot create {self.tmp}: {os.strerror(errno.ENOSPC)}") from None
            raise
        self.fd = self.file.id.get_vfd_handle()
        _WRITING.add(self)
        self.reserved = 0
        try:
            self._reserve(RESERVE_MARGIN)
        except OSError:
            try:
                _WRITING.discard(self)
                self.file.close()  # else left open, holding its space, until collected
            finally:
                self.remove()
            raise
        self.file.attrs["step"] = step
        self.datasets: dict[str, tuple[h5py.h5d.DatasetID, tuple]] = {}

    def _reserve(self, nbytes: int) -> None:
        """Allocate disk space for what is about to be written: the HDF5 library cannot
        recover from a write of its metadata that fails for want of space (closing the
        file then crashes it), so a full disk must fail here, in a clean OSError."""
        reserve_space(self.fd, self.reserved, nbytes, self.tmp)
        self.reserved += nbytes

    def define(self, name, dtype, shape, real_dtype, block=None):
        shape = tuple(shape)
        self._reserve(math.prod(shape) * np.dtype(dtype).itemsize + metadata_margin(name))
        space = h5py.h5s.create_simple(shape) if shape else h5py.h5s.create(h5py.h5s.SCALAR)
        dsid = h5py.h5d.create(self.file.id, name.encode(), _file_type(np.dtype(dtype)), space,
                               lcpl=_LINK_CREATE)
        if real_dtype != _dtype_name(dtype):
            _string_attribute(dsid, b"dtype", real_dtype)
        self.datasets[name] = (dsid, shape, np.dtype(dtype).str)

    def put(self, name, array, start):
        dsid, shape, _ = self.datasets[name]
        if array.size == 0:
            return
        mtype = _file_type(array.dtype)  # given, h5py would derive it on every call
        if shape == () or (not any(start) and array.shape == shape):
            dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, array.reshape(shape), mtype=mtype)
            return
        file_space = dsid.get_space()
        file_space.select_hyperslab(tuple(start), tuple(array.shape))
        dsid.write(h5py.h5s.create_simple(tuple(array.shape)), file_space, array, mtype=mtype)

    writes_at_put = True

    def write_out(self):
        pass  # puts are written at once

    def write_manifest(self, manifest: bytes) -> None:
        self._reserve(len(manifest) + metadata_margin(MANIFEST))
        self.file.create_dataset(MANIFEST, data=np.frombuffer(manifest, dtype=np.uint8))

    def seal(self, manifest):
        self._write_locations()
        super().seal(manifest)

    def _write_locations(self) -> None:
        """``{NAME: [OFFSET, NBYTES, DTYPE]}`` of every dataset whose storage is allocated
        (contiguous: its bytes never move), ``DTYPE`` numpy's ``dtype.str`` (byte order
        included); 1 us a dataset."""
        table = {}
        for name, (dsid, shape, dtype) in self.datasets.items():
            offset = dsid.get_offset()
            if offset is not None:
                table[name] = [offset, math.prod(shape) * np.dtype(dtype).itemsize, dtype]
        data = json.dumps(table, separators=(",", ":")).encode()
        self._reserve(len(data) + metadata_margin(LOCATIONS))
        self.file.create_dataset(LOCATIONS, data=np.frombuffer(data, dtype=np.uint8))

    def close_files(self):
        self.datasets.clear()
        _WRITING.discard(self)
        self.file.close()
        trim(self.tmp)


_WRITING: "weakref.WeakSet[HDF5StepWriter]" = weakref.WeakSet()  # files open for writing


def _writes_elsewhere_in_child() -> None:
    """A child made by fork (a DataLoader worker) inherits the files this process is
    writing, and the HDF5 library flushes open files when a process exits: the child
    would write the metadata a file had at the fork over what the parent wrote since.
    There, each such file's descriptor is pointed at a file in memory instead (no call
    into h5py: another thread may have held its lock at the fork)."""
    for writer in list(_WRITING):
        memory = (os.memfd_create("datastates-hist-forked") if hasattr(os, "memfd_create")
                  else os.open(os.devnull, os.O_RDWR))
        os.dup2(memory, writer.fd)
        os.close(memory)
    _WRITING.clear()


os.register_at_fork(after_in_child=_writes_elsewhere_in_child)



class HDF5StepReader(StepReader):
    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"step data {path} is missing")
        try:
            self.file = h5py.File(path, "r")
        except OSError as exc:  # h5py's message does not name the file
            raise OSError(f"{path} cannot be opened as HDF5: {exc}") from exc
        self.path = path
        self.hard_links: set[str] = set()  # paths checked to be hard links
        try:  # the file HDF5 opened (a second open of the path might find a newer file there)
            self.fd = os.dup(self.file.id.get_vfd_handle())
        except (OSError, TypeError, ValueError):
            self.file.close()
            raise
        self.size = os.fstat(self.fd).st_size
        self._map: mmap.mmap | None = None
        self._locations: dict | None = None

    def _dataset(self, name: str, through_hdf5: bool = True):
        """Dataset ``name``, if it and every group on its path are hard links (a soft or
        external link may lead to other data or another file), and, if it is to be read
        ``through_hdf5``, its bytes lie in this file (external storage or a virtual
        layout would read other files; a byte range of this file cannot)."""
        parts = name.split("/")
        for end in range(1, len(parts) + 1):
            path = "/".join(parts[:end])
            if path in self.hard_links:
                continue
            kind = self.file.id.links.get_info(path.encode()).type
            if kind != h5py.h5l.TYPE_HARD:
                what = "an external link" if kind == h5py.h5l.TYPE_EXTERNAL else "a soft link"
                raise ValueError(f"{self.path} holds {what} at {path!r}; step files hold only their own datasets")
            self.hard_links.add(path)
        dsid = h5py.h5d.open(self.file.id, name.encode())
        if through_hdf5:
            self._check_inside(name, dsid)
        return dsid

    def _check_inside(self, name: str, dsid) -> None:
        # whatever H5Dget_offset says (10 us a dataset): a crafted layout may name external
        # storage and an address in this file at once, and HDF5 reads the external storage
        plist = dsid.get_create_plist()
        if plist.get_external_count() or plist.get_layout() == h5py.h5d.VIRTUAL:
            raise ValueError(f"dataset {name!r} of {self.path} stores its data outside the file")

    def manifest(self) -> bytes:
        dsid = self._dataset(MANIFEST)
        if dsid.get_storage_size() < dsid.get_space().get_select_npoints():
            raise ValueError(f"the manifest of {self.path} declares more bytes than the file stores for it")
        return self.file[MANIFEST][()].tobytes()

    def _located(self, name: str, dtype: np.dtype, nbytes: int) -> int | None:
        """The offset of dataset ``name``'s bytes by the file's table of locations, if it
        lists the dataset as ``nbytes`` of ``dtype`` inside the file. Such a range is read
        as it is: never through a link, never outside this file; the caller checks the
        bytes against their checksum and, where they differ, reads again with :meth:`read`
        (another tool may have rewritten the dataset elsewhere since: the table went stale)."""
        if self._locations is None:
            self._locations = self._read_locations()
        entry = self._locations.get(name)
        if (isinstance(entry, list) and len(entry) == 3 and entry[1:] == [nbytes, dtype.str]
                and type(entry[0]) is int and 0 <= entry[0] <= self.size - nbytes):
            return entry[0]
        return None

    def _read_locations(self) -> dict:
        """The table of locations, or ``{}`` where the file has none (written before it
        existed, or by another tool) or none this writer could have written (not a
        contiguous 1-D uint8 dataset of at most :data:`LOCATIONS_BYTES`, not a JSON object,
        or failing in any way, its header damaged included): HDF5 is asked then, and
        ``verify`` (which always asks HDF5) names what is damaged."""
        try:
            if not self.file.id.links.exists(LOCATIONS.encode()):
                return {}
            dsid = self._dataset(LOCATIONS, through_hdf5=False)
            nbytes = dsid.get_storage_size()
            if len(dsid.shape) != 1 or dsid.shape[0] != nbytes or nbytes > LOCATIONS_BYTES:
                return {}
            offset = self._offset(LOCATIONS, dsid, np.dtype(np.uint8), nbytes)
            if offset is None:
                return {}
            raw = np.empty(nbytes, np.uint8)
            self._pread(LOCATIONS, raw, offset)
            table = json.loads(raw.tobytes())
        except Exception:
            return {}
        return table if isinstance(table, dict) else {}

    def read(self, name, out, start, part=None):
        self._dataset(name)
        ds = self.file[name]
        if out.size == 0:
            return
        if ds.shape == ():
            out[...] = ds[()]
        else:
            ds.read_direct(out, source_sel=_box(start, out.shape))

    def read_many(self, requests):
        """Whole datasets. A contiguous dataset of the memory's own type is a plain byte
        range of the file: read with ``preadv`` straight into ``out``, by two threads
        for a batch of several MiB (h5py reads with one; HDF5 serialises its calls).
        The small GPT's restore from ``/dev/shm``: 63 -> 47-50 ms. Other datasets are
        read through h5py's low-level API, the memory type given (h5py would derive
        it on every call)."""
        direct, through_h5py, nbytes = [], [], 0
        for name, out, start in requests:
            if out.size == 0:
                continue
            offset = self._located(name, out.dtype, out.nbytes) if _writable(out) else None
            if offset is not None:
                direct.append((name, out, offset))
                nbytes += out.nbytes
                continue
            dsid = self._dataset(name, through_hdf5=False)
            shape = dsid.shape
            if shape != out.shape and not (shape == () and out.shape in ((), (1,))):
                raise ValueError(f"dataset {name} has shape {shape}, expected {out.shape}")
            offset = self._byte_range(name, dsid, out)
            if offset is None:
                self._check_inside(name, dsid)
                through_h5py.append((dsid, out))
            else:
                direct.append((name, out, offset))
                nbytes += out.nbytes
        for dsid, out in through_h5py:
            dsid.read(h5py.h5s.ALL, h5py.h5s.ALL, out, mtype=_file_type(out.dtype))
        if nbytes < DIRECT_THREADS_BYTES or len(direct) < 2:
            for request in direct:
                self._pread(*request)
            return
        # two halves by bytes: preadv releases the GIL, and the copy out of the page
        # cache (and the first touch of fresh destination pages) runs on both cores
        half, acc = len(direct), 0
        for i, (_, out, _) in enumerate(direct):
            acc += out.nbytes
            if acc >= nbytes // 2:
                half = i + 1
                break
        with ThreadPoolExecutor(1, thread_name_prefix="dh-hdf5-read") as pool:
            other = pool.submit(lambda: [self._pread(*r) for r in direct[half:]])
            for request in direct[:half]:
                self._pread(*request)
            other.result()

    def _byte_range(self, name: str, dsid, out: np.ndarray) -> int | None:
        """The file offset of dataset ``name``'s bytes if they are ``out``'s bytes as they
        are: contiguous (no filters), allocated, of ``out``'s own type, and inside the
        file. None where h5py must read it."""
        return self._offset(name, dsid, out.dtype, out.nbytes) if _writable(out) else None

    def _offset(self, name: str, dsid, dtype: np.dtype, nbytes: int) -> int | None:
        offset = dsid.get_offset()
        if offset is None or dsid.get_type() != _file_type(dtype):
            return None
        if dsid.get_storage_size() != nbytes or offset + nbytes > self.size:
            raise ValueError(f"dataset {name} of {self.path} declares {nbytes} bytes at offset {offset}, "
                             f"which the file's {self.size} bytes do not hold")
        return offset

    def mapped_bytes(self, requests):
        """Contiguous uint8 datasets as views of the file mapped read-only: a restore's
        encoded blobs are decoded from the page cache, neither copied nor staged in fresh
        memory (the small GPT's blobs: 36 ms of reads on two threads -> 4 ms). The file
        was checked to hold each range; like any mapped file (``torch.load(mmap=True)``,
        safetensors), one that another program truncates while it is read ends the
        process with SIGBUS."""
        views = {}
        for name, nbytes in requests:
            if nbytes == 0:
                continue
            offset = self._located(name, np.dtype(np.uint8), nbytes)
            if offset is None:
                dsid = self._dataset(name, through_hdf5=False)
                offset = self._offset(name, dsid, np.dtype(np.uint8), nbytes) if dsid.shape == (nbytes,) else None
            if offset is None:
                continue  # read_many reads it, or names what is wrong with it
            if self._map is None:
                self._map = mmap.mmap(self.fd, 0, prot=mmap.PROT_READ)  # its own dup of the fd
            views[name] = np.frombuffer(self._map, np.uint8, nbytes, offset)
        return views

    def _pread(self, name: str, out: np.ndarray, offset: int) -> None:
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise ValueError(f"dataset {name} of {self.path} ends {len(view) - done} bytes early")
            done += n

    def close(self):
        self._map = None  # unmapped once the last view of it is gone
        if self.fd >= 0:  # once: the number may belong to another file afterwards
            os.close(self.fd)
            self.fd = -1
        self.file.close()


class HDF5Backend(Backend):
    """Plain HDF5 files through h5py."""

    name = "hdf5"
    suffix = SUFFIX

    def writer_at(self, final, step):
        return HDF5StepWriter(final, step)

    def reader_at(self, path):
        return HDF5StepReader(path)
