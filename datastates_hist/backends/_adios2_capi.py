"""A thin ctypes binding to ADIOS2's C API (``libadios2_c.so`` from the ``adios2`` wheel).

Why not ``import adios2``: its Python bindings hold the GIL for the whole of a
write, so a flush from a background thread would stall the training thread.
``ctypes`` releases the GIL around every foreign call, so the same BP5 writes
and reads run beside training at full speed (see docs/performance.md).

Only the calls this package needs are bound. Every call is checked; a failure
raises :class:`Adios2Error` naming the call and the file.

ADIOS2 prints every failed call's error on stderr (from C++; its C bindings
log it unconditionally, and no parameter or environment variable turns that
off in 2.12) before it returns the error code. So a writer of its own file
reserves the disk space of each step before ending it: a full disk fails in
our ``OSError`` before ADIOS2 meets it. Closing a file given up is the one
call made when an error is expected; what ADIOS2 prints then is kept and put
into the exception (:func:`stderr_kept`).
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import threading
from ctypes import POINTER, c_char_p, c_int, c_size_t, c_void_p

import numpy as np

from ._stderr import stderr_kept
from .space import reserve_after_end, reserve_space, trim

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
# bp5_files.PROFILE.
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
        self.serial = comm is None
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


# What a BP5 step adds to each file of a serial writer, at most (ADIOS2 2.12, measured
# with 1 to 2000 variables, names of 50 and 200 characters, 1 to 20 blocks each):
# each step's data starts 4096-aligned, blocks 8-aligned; md.0 holds ~56 bytes per
# defined variable and ~30 per block; mmd.0 holds ~40 bytes plus the name of every
# variable, all again whenever a step defines a new one; md.idx ~40 bytes.
_PAGE = 4096
_PER_ENTRY = 64
# The profile BP5 writes on close whatever ``Profile`` says (ADIOS2 2.12), and whose
# failed write on a full disk fails the close: a serial writer's goes to /dev/null.
PROFILE = "profiling.json"
_RESERVED = ("data.0", "md.0", "mmd.0", "md.idx")  # the files of a serial writer
# Space a serial writer holds from before ADIOS2 opens its file until it closes it, and
# frees to close a file given up: closing writes metadata, which a disk filled to the
# last page would refuse (the context could then only be abandoned).
ROOM, ROOM_BYTES = "closing-room", 64 << 10


class FileWriter:
    """Writes one BP5 file holding one ADIOS2 step, variables put by pointer."""

    def __init__(self, adios: Adios, path: str, parameters: dict[str, str]):
        self.adios, self.lib, self.path = adios, adios.lib, path
        if adios.serial:
            try:
                self._hold_room()
            except OSError:  # a full disk: ADIOS2 has opened nothing yet, so its context goes too
                adios.close()
                raise
        self.io = adios.new_io("BP5", parameters)
        self.engine = self.lib.adios2_open(self.io, path.encode(), MODE_WRITE)
        if not self.engine:
            raise Adios2Error(f"ADIOS2 could not open {path} for writing")
        if adios.serial:
            try:
                os.symlink(os.devnull, os.path.join(path, PROFILE))
            except OSError:
                pass  # the profile is written, as without the link
        status = c_int(0)
        rc = self.lib.adios2_begin_step(self.engine, STEP_MODE_APPEND, -1.0, ctypes.byref(status))
        if rc != 0:
            engine, self.engine = self.engine, None
            try:
                adios.check(rc, "begin_step", path)  # first: it reads the errno the failure left
            finally:
                # a context finalized with an engine still open can abort the process
                if self.lib.adios2_close(engine) != 0:
                    adios.abandon()
        self.variables: dict[str, int] = {}
        self.selected: dict[str, tuple] = {}  # each variable's selection: (start, count)
        self.step_failed = False  # ADIOS2 could not write a step
        self.space_refused = False  # a step's space could not be reserved: it is still open
        self.itemsizes: dict[str, int] = {}
        self.names_bytes = 0  # what the names of all variables take in mmd.0
        self.defined = False  # a variable defined in this ADIOS2 step
        self.put_bytes = self.put_blocks = 0  # put in this ADIOS2 step

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
        self.itemsizes[name] = dtype.itemsize
        self.names_bytes += _PER_ENTRY + len(name.encode())
        self.defined = True

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
        self.put_bytes += math.prod(count) * self.itemsizes[name]
        self.put_blocks += 1

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
        if self.adios.serial:  # a collective file's subfiles are ADIOS2's to assign
            try:
                self._reserve()
            except OSError:
                self.space_refused = True
                raise
        rc = self.lib.adios2_end_step(engine)
        self.step_failed = rc != 0
        self.adios.check(rc, "end_step", self.path)
        self.defined, self.put_bytes, self.put_blocks = False, 0, 0

    def _reserve(self) -> None:
        """Reserve what ending this ADIOS2 step writes into each file (OSError if the disk is full).

        The metadata first: when the data's space is refused, closing the file still
        writes a step's metadata (the whole step again if it is the file's first).
        """
        need = {
            "md.0": _PAGE + _PER_ENTRY * (len(self.variables) + self.put_blocks),
            "mmd.0": _PAGE + (self.names_bytes if self.defined else 0),
            "md.idx": _PAGE,
            "data.0": self.put_bytes + 8 * self.put_blocks + _PAGE,
        }
        for name, nbytes in need.items():
            path = os.path.join(self.path, name)
            if os.path.exists(path):
                reserve_after_end(path, nbytes)

    def _hold_room(self) -> None:
        os.makedirs(self.path, exist_ok=True)
        room = os.path.join(self.path, ROOM)
        fd = os.open(room, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            reserve_space(fd, 0, ROOM_BYTES, room)
        finally:
            os.close(fd)

    def _free_room(self) -> None:
        try:
            os.remove(os.path.join(self.path, ROOM))
        except FileNotFoundError:
            pass  # a collective writer's, or freed already

    def _files(self, prefix: str = "") -> list[str]:
        names = os.listdir(self.path) if os.path.isdir(self.path) else []
        return [os.path.join(self.path, name) for name in names if name.startswith(prefix)]

    def _trim(self, empty: bool = False) -> None:
        """Free the space reserved and not written, or (``empty``) all the files hold
        (a collective file's files are still written by other ranks: never reserved)."""
        if self.adios.serial:
            for path in self._files():
                if os.path.basename(path) not in _RESERVED:
                    continue
                if empty:
                    os.truncate(path, 0)
                else:
                    trim(path)

    def close(self) -> None:
        """End the step and close the file (writes the metadata), then free the
        space reserved and not used.

        If that fails (a full disk), or an earlier step failed, the file is
        given up: its data files are emptied, which frees their space, so that
        ADIOS2 can close it; if even that fails, the context is abandoned rather
        than finalized (see :meth:`Adios.abandon`), and what ADIOS2 printed is
        added to the error, which is raised either way.
        """
        if not self.engine:
            return
        engine, self.engine = self.engine, None
        try:
            if self.step_failed or self.space_refused:  # ADIOS2 prints each failure: no second one
                raise Adios2Error(f"ADIOS2 gave up {self.path}: a step of it could not be written")
            self._end_step(engine)
            self.adios.check(self.lib.adios2_close(engine), "close", self.path)
        except (Adios2Error, OSError) as exc:
            printed: list[str] = []
            with stderr_kept(printed):  # the file is given up: what ADIOS2 prints now is this error's
                if self.space_refused:
                    # ended first, as a failed step is: closing would end it itself, and a
                    # write failing there leaves the file unclosable (measured: the context
                    # was abandoned in most cases of a full disk)
                    self.lib.adios2_end_step(engine)
                for path in self._files("data."):
                    os.truncate(path, 0)
                self._free_room()
                closed = self.lib.adios2_close(engine) == 0
            self._trim(empty=not closed)  # files left open hold no space at least
            if not closed:
                self.adios.abandon()
            ctypes.set_errno(0)
            if printed[0]:
                raise Adios2Error(f"{exc} (ADIOS2, giving the file up: {printed[0]})") from exc
            raise
        self._free_room()
        self._trim()


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
