"""A run's layout on disk, and the one check of every step path taken from stored data.

Layout of a run directory::

    RUN/index.sqlite            the index (committed steps, tensor records, statistics)
    RUN/steps/<step><suffix>    one unit of step data per step (file or folder, by backend;
                                ``.ranks``: a folder of one file per rank)
    RUN/writer.lock             held by the one process that may write

An index row names its step's unit (``location``). An index or a manifest may be
damaged or crafted, so a location is used only once :func:`unit_path` has checked it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat

from .backends import get_backend
from .backends.base import entry_path, step_stem
from .backends.ranks import RANKS_SUFFIX
from .errors import CorruptionError, StoreLockedError

STEPS_DIR = "steps"
PARTIAL = ".partial"  # a unit being written; never committed
WRITER_LOCK = "writer.lock"
# The largest step: the index stores steps as SQLite INTEGER (signed 64-bit);
# the name of a step's unit (backends.base.step_stem) holds any of them.
MAX_STEP = 2**63 - 1


def steps_dir(run_dir: str) -> str:
    return os.path.join(run_dir, STEPS_DIR)


def finished_units(run_dir: str) -> list[str]:
    """The entries of ``steps/`` that are not being written, sorted ([] without ``steps/``)."""
    try:
        entries = os.listdir(steps_dir(run_dir))
    except FileNotFoundError:
        return []
    return sorted(e for e in entries if not e.endswith(PARTIAL))


def unit_suffixes(step: int, backend: str) -> tuple[str, ...]:
    """The suffixes the unit of ``step`` written by ``backend`` may have: the
    backend's (one file or folder) or ``.ranks`` (a folder of one file per rank);
    none for a registered backend that declares no suffix of its own."""
    try:
        suffix = get_backend(backend).suffix
    except ValueError as exc:  # an unknown backend name: the row is not one a writer made
        raise CorruptionError(f"step {step} names an unknown backend: {exc}") from None
    return (suffix, RANKS_SUFFIX) if suffix else ()


def unit_path(run_dir: str, row) -> str:
    """The path of the unit of the committed step ``row`` (an index row).

    Refused with :class:`CorruptionError` unless the location is the step's own
    unit name (:func:`check_location`) and the entry in ``steps/`` is not a
    symbolic link: both together keep the path inside ``steps/``. A unit that
    is missing is not refused here: reading it reports it missing, pruning has
    nothing to delete.
    """
    return entry_path(steps_dir(run_dir), check_location(run_dir, row), f"the data of step {row.step} in {run_dir}")


def check_location(run_dir: str, row) -> str:
    """The location of index row ``row``, once it is the step's own unit name:
    the step's zero-padded number and one of its suffixes (any plain suffix for
    a backend that declares none). So one plain name (no ``/``, no ``..``, not
    absolute), and not the unit of another step. Raises :class:`CorruptionError`
    otherwise."""
    stem, suffixes = step_stem(row.step), unit_suffixes(row.step, row.backend)
    location = row.location
    rest = location[len(stem):] if isinstance(location, str) and location.startswith(stem) else None
    if rest is None or not (rest in suffixes if suffixes else _plain_suffix(rest)):
        must = (" or ".join(repr(stem + s) for s in suffixes) if suffixes
                else f"'{stem}' and the suffix of backend {row.backend!r}")
        raise CorruptionError(
            f"the index row of step {row.step} in {run_dir} names {location!r} as the step's data, "
            f"which must be {must} in {steps_dir(run_dir)}: the index is damaged "
            f"(rebuild it with: datastates-hist repair {run_dir})"
        )
    return location


def _plain_suffix(rest: str) -> bool:
    return rest == "" or (rest.startswith(".") and "/" not in rest and "\0" not in rest
                          and not rest.endswith(PARTIAL))


def unit_bytes(path: str) -> int:
    """The bytes of the regular files of a unit (the file itself, or every file
    under the folder); symbolic links are neither followed nor counted."""
    if not os.path.isdir(path) or os.path.islink(path):
        return _file_bytes(path)
    return sum(_file_bytes(os.path.join(root, f)) for root, _dirs, files in os.walk(path) for f in files)


def _file_bytes(path: str) -> int:
    st = os.lstat(path)
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def take_writer_lock(run_dir: str) -> int:
    """Take the run's one writer lock (``RUN/writer.lock``, flock); its descriptor.
    Raises :class:`StoreLockedError` naming the holder."""
    path = os.path.join(run_dir, WRITER_LOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise PermissionError(f"the run directory {run_dir} is not writable: {exc.strerror.lower()} "
                              f"(cannot open its lock file {path})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise StoreLockedError(
            f"{run_dir} is being written by {holder}; one writer per run "
            "(read it with datastates_hist.open, or wait for that process to end)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
    return fd
