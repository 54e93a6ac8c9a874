"""A thin ctypes binding to ADIOS2's C API (``libadios2_c.so`` from the ``adios2`` wheel).

Why not ``import adios2``: its Python bindings hold the GIL for the whole of a
write, so a flush from a background thread would stall the training thread.
``ctypes`` releases the GIL around every foreign call, so the same BP5 writes
and reads run beside training at full speed (see docs/performance.md).

Only the calls this package needs are bound. Every call is checked; a failure
raises :class:`Adios2Error` naming the call and the file.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from ctypes import POINTER, c_char_p, c_int, c_size_t, c_void_p

import numpy as np

# enum values from adios2/c/adios2_c_types.h
MODE_WRITE = 1
MODE_READ_RANDOM_ACCESS = 6
MODE_DEFERRED = 4
MODE_SYNC = 5
STEP_MODE_APPEND = 0
CONSTANT_DIMS_TRUE = 1

_TYPES = {
    np.dtype("float32"): 1,
    np.dtype("float64"): 2,
    np.dtype("complex64"): 3,
    np.dtype("complex128"): 4,
    np.dtype("int8"): 5,
    np.dtype("int16"): 6,
    np.dtype("int32"): 7,
    np.dtype("int64"): 8,
    np.dtype("uint8"): 9,
    np.dtype("uint16"): 10,
    np.dtype("uint32"): 11,
    np.dtype("uint64"): 12,
}


# Every IO asks for no profiling files. BP5 in ADIOS2 2.12 ignores it (measured):
# its readers and writers write one on every close, see remove_reader_profile and
# adios2_bp5.PROFILE.
IO_DEFAULTS = {"Profile": "Off"}


class Adios2Error(RuntimeError):
    """A call into ADIOS2's C library failed."""


def reader_profile_path(path: str) -> str:
    """Where a BP5 reader of ``path`` writes its profile when closed: always ``/tmp``
    (not ``$TMPDIR``), named by the file's last path component and the process id in hex."""
    return f"/tmp/{os.path.basename(path)}_{os.getpid():x}_profiling.json"


def remove_reader_profile(path: str) -> None:
    """Remove the profile this process's reader of ``path`` left in ``/tmp``:
    one file per read step otherwise (300 after verifying 300 steps)."""
    try:
        os.remove(reader_profile_path(path))
    except OSError:
        pass  # none written (the reader failed before), or removed meanwhile


_lib = None
_mpi_init = None
_lib_lock = threading.Lock()


def _signatures(lib: ctypes.CDLL) -> None:
    sizes = POINTER(c_size_t)
    table = {
        "adios2_init_serial": ([], c_void_p),
        "adios2_declare_io": ([c_void_p, c_char_p], c_void_p),
        "adios2_finalize": ([c_void_p], c_int),
        "adios2_set_engine": ([c_void_p, c_char_p], c_int),
        "adios2_set_parameter": ([c_void_p, c_char_p, c_char_p], c_int),
        "adios2_define_variable": (
            [c_void_p, c_char_p, c_int, c_size_t, sizes, sizes, sizes, c_int],
            c_void_p,
        ),
        "adios2_inquire_variable": ([c_void_p, c_char_p], c_void_p),
        "adios2_variable_ndims": ([sizes, c_void_p], c_int),
        "adios2_variable_shape": ([sizes, c_void_p], c_int),
        "adios2_set_selection": ([c_void_p, c_size_t, sizes, sizes], c_int),
        "adios2_open": ([c_void_p, c_char_p, c_int], c_void_p),
        "adios2_begin_step": ([c_void_p, c_int, ctypes.c_float, POINTER(c_int)], c_int),
        "adios2_put": ([c_void_p, c_void_p, c_void_p, c_int], c_int),
        "adios2_perform_puts": ([c_void_p], c_int),
        "adios2_get": ([c_void_p, c_void_p, c_void_p, c_int], c_int),
        "adios2_perform_gets": ([c_void_p], c_int),
        "adios2_end_step": ([c_void_p], c_int),
        "adios2_close": ([c_void_p], c_int),
        "adios2_set_step_selection": ([c_void_p, c_size_t, c_size_t], c_int),
    }
    for name, (args, res) in table.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res


def library() -> ctypes.CDLL:
    """Load ``libadios2_c.so`` from the installed ``adios2`` package (once)."""
    global _lib
    with _lib_lock:
        if _lib is None:
            import importlib.util

            spec = importlib.util.find_spec("adios2")
            if spec is None or not spec.submodule_search_locations:
                raise ImportError(
                    "the ADIOS2 backend needs the 'adios2' package: pip install adios2"
                )
            folder = list(spec.submodule_search_locations)[0]
            path = os.path.join(folder, "libadios2_c.so")
            if not os.path.exists(path):
                raise ImportError(f"the adios2 package at {folder} has no libadios2_c.so")
            # use_errno: a failed write is told apart (a full disk) by the errno it left
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL, use_errno=True)
            _signatures(lib)
            _lib = lib
        return _lib


def mpi_init():
    """``adios2_init_mpi`` from ``libadios2_c_mpi.so`` (an ADIOS2 built with MPI), or ImportError."""
    global _mpi_init
    lib = library()
    with _lib_lock:
        if _mpi_init is None:
            from mpi4py import MPI

            path = os.path.join(os.path.dirname(lib._name), "libadios2_c_mpi.so")
            if not os.path.exists(path):
                raise ImportError(
                    "the installed adios2 was built without MPI (no libadios2_c_mpi.so): "
                    "run tools/install_mpi.sh, or write one file per rank with comm='torch'"
                )
            mpi = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL, use_errno=True)
            # MPI_Comm is an int in MPICH and a pointer in Open MPI
            mpi.adios2_init_mpi.argtypes = [c_int if MPI._sizeof(MPI.Comm) == 4 else c_void_p]
            mpi.adios2_init_mpi.restype = c_void_p
            _mpi_init = mpi.adios2_init_mpi
        return _mpi_init


def _sizes(values) -> ctypes.Array:
    return (c_size_t * max(len(values), 1))(*values)


class Adios:
    """One ADIOS2 context with one IO per opened file."""

    _counter = 0

    def __init__(self, comm=None) -> None:
        """``comm``: an mpi4py communicator for collective files (collective call), or None."""
        self.lib = library()
        if comm is None:
            self.handle = self.lib.adios2_init_serial()
        else:
            from mpi4py import MPI

            self.handle = mpi_init()(MPI._handleof(comm))
        if not self.handle:
            raise Adios2Error("adios2_init failed")

    def check(self, rc: int, what: str, path: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            ctypes.set_errno(0)
            if err in (errno.ENOSPC, errno.EDQUOT):
                raise OSError(err, f"{os.strerror(err)} (ADIOS2 {what} failed)", path)
            raise Adios2Error(f"ADIOS2 {what} failed (error {rc}) on {path}")

    def new_io(self, engine: str, parameters: dict[str, str]) -> int:
        """An IO of ``engine`` with ``parameters`` over :data:`IO_DEFAULTS`."""
        Adios._counter += 1
        name = f"io{Adios._counter}".encode()
        io = self.lib.adios2_declare_io(self.handle, name)
        if not io:
            raise Adios2Error("adios2_declare_io failed")
        self.check(self.lib.adios2_set_engine(io, engine.encode()), "set_engine", engine)
        for key, value in {**IO_DEFAULTS, **parameters}.items():
            self.check(
                self.lib.adios2_set_parameter(io, key.encode(), str(value).encode()),
                f"set_parameter {key}={value}",
                engine,
            )
        return io

    def close(self) -> None:
        if self.handle:
            self.lib.adios2_finalize(self.handle)
            self.handle = None

    def abandon(self) -> None:
        """Never finalize this context: an engine that could not close would be
        closed again by a destructor, which aborts the process when that fails."""
        self.handle = None


class FileWriter:
    """Writes one BP5 file holding one ADIOS2 step, variables put by pointer."""

    def __init__(self, adios: Adios, path: str, parameters: dict[str, str]):
        self.adios, self.lib, self.path = adios, adios.lib, path
        self.io = adios.new_io("BP5", parameters)
        self.engine = self.lib.adios2_open(self.io, path.encode(), MODE_WRITE)
        if not self.engine:
            raise Adios2Error(f"ADIOS2 could not open {path} for writing")
        status = c_int(0)
        rc = self.lib.adios2_begin_step(self.engine, STEP_MODE_APPEND, -1.0, ctypes.byref(status))
        adios.check(rc, "begin_step", path)
        self.variables: dict[str, int] = {}
        self.selected: dict[str, tuple] = {}  # each variable's selection: (start, count)
        self.step_failed = False

    def define(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        """Declare a global array ``name`` of ``shape``; blocks are put with :meth:`put`."""
        if dtype not in _TYPES:
            raise TypeError(f"ADIOS2 has no type for numpy dtype {dtype} (variable {name})")
        dims = _sizes(shape)
        var = self.lib.adios2_define_variable(
            self.io, name.encode(), _TYPES[dtype], len(shape), dims, _sizes([0] * len(shape)), dims, 0,
        )
        if not var:
            raise Adios2Error(f"ADIOS2 could not define variable {name} in {self.path}")
        self.variables[name] = var
        self.selected[name] = ((0,) * len(shape), tuple(shape))  # what define selects

    def put(self, name: str, pointer: int, start, count) -> None:
        """Put one block (``start``/``count`` in the global array) read from ``pointer``.

        The memory must stay valid and unchanged until :meth:`perform_puts`,
        :meth:`next_step` or :meth:`close` returns.
        """
        var = self.variables[name]
        box = (tuple(start), tuple(count))
        if box != self.selected[name]:  # a ctypes call saved for most puts (a whole small tensor)
            rc = self.lib.adios2_set_selection(var, len(start), _sizes(start), _sizes(count))
            self.adios.check(rc, f"set_selection of {name}", self.path)
            self.selected[name] = box
        rc = self.lib.adios2_put(self.engine, var, c_void_p(pointer), MODE_DEFERRED)
        self.adios.check(rc, f"put of {name}", self.path)

    def perform_puts(self) -> None:
        """Copy every block put so far into ADIOS2's buffers; their memory may then be reused."""
        self.adios.check(self.lib.adios2_perform_puts(self.engine), "perform_puts", self.path)

    def next_step(self) -> None:
        """End this ADIOS2 step, which writes every block put so far straight from its
        memory (no copy into ADIOS2's buffers), and begin the next one."""
        self._end_step(self.engine)
        status = c_int(0)
        rc = self.lib.adios2_begin_step(self.engine, STEP_MODE_APPEND, -1.0, ctypes.byref(status))
        self.adios.check(rc, "begin_step", self.path)

    def _end_step(self, engine: int) -> None:
        rc = self.lib.adios2_end_step(engine)
        self.step_failed = rc != 0
        self.adios.check(rc, "end_step", self.path)

    def close(self) -> None:
        """End the step and close the file (writes the metadata).

        If that fails (a full disk), or an earlier step failed, the file is
        given up: its data files are emptied, which frees their space, so that
        ADIOS2 can close it; if even that fails, the context is abandoned rather
        than finalized (see :meth:`Adios.abandon`). The error is raised either way.
        """
        if not self.engine:
            return
        engine, self.engine = self.engine, None
        try:
            if self.step_failed:  # ending it again would fail again, and ADIOS2 prints each failure
                raise Adios2Error(f"ADIOS2 gave up {self.path}: a step of it could not be written")
            self._end_step(engine)
            self.adios.check(self.lib.adios2_close(engine), "close", self.path)
        except (Adios2Error, OSError):
            for name in os.listdir(self.path) if os.path.isdir(self.path) else []:
                if name.startswith("data."):
                    os.truncate(os.path.join(self.path, name), 0)
            if self.lib.adios2_close(engine) != 0:
                self.adios.abandon()
            ctypes.set_errno(0)
            raise


class FileReader:
    """Random-access reads of selections from one BP5 file."""

    def __init__(self, adios: Adios, path: str):
        self.adios, self.lib, self.path = adios, adios.lib, path
        self.io = adios.new_io("BP5", {})
        self.engine = self.lib.adios2_open(self.io, path.encode(), MODE_READ_RANDOM_ACCESS)
        if not self.engine:
            raise Adios2Error(f"ADIOS2 could not open {path} for reading")

    def _variable(self, name: str) -> int:
        var = self.lib.adios2_inquire_variable(self.io, name.encode())
        if not var:
            raise KeyError(f"variable {name!r} is not in {self.path}")
        return var

    def get(self, name: str, pointer: int, start, count, deferred: bool = False, step: int = 0) -> None:
        """Read the box ``start``/``count`` of ``name`` into contiguous memory at ``pointer``,
        from the ``step``-th of the ADIOS2 steps that ``name`` was written in; ``deferred``:
        at :meth:`perform_gets`, with the other deferred reads."""
        var = self._variable(name)
        rc = self.lib.adios2_set_step_selection(var, step, 1)
        self.adios.check(rc, f"set_step_selection of {name}", self.path)
        rc = self.lib.adios2_set_selection(var, len(start), _sizes(start), _sizes(count))
        self.adios.check(rc, f"set_selection of {name}", self.path)
        rc = self.lib.adios2_get(self.engine, var, c_void_p(pointer), MODE_DEFERRED if deferred else MODE_SYNC)
        self.adios.check(rc, f"get of {name}", self.path)

    def perform_gets(self) -> None:
        self.adios.check(self.lib.adios2_perform_gets(self.engine), "perform_gets", self.path)

    def shape(self, name: str) -> tuple[int, ...]:
        """The global shape of array ``name``."""
        var = self._variable(name)
        ndims = c_size_t(0)
        rc = self.lib.adios2_variable_ndims(ctypes.byref(ndims), var)
        self.adios.check(rc, f"ndims of {name}", self.path)
        out = (c_size_t * max(ndims.value, 1))()
        self.adios.check(self.lib.adios2_variable_shape(out, var), f"shape of {name}", self.path)
        return tuple(out[i] for i in range(ndims.value))

    def close(self) -> None:
        if self.engine:
            engine, self.engine = self.engine, None
            try:
                self.adios.check(self.lib.adios2_close(engine), "close", self.path)
            finally:
                remove_reader_profile(self.path)
