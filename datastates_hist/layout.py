"""A run's layout on disk: the names of its files and folders, and its writer lock.

Layout of a run directory::

    RUN/index.sqlite            the index (committed steps, tensor records, statistics)
    RUN/steps/<step><suffix>    one unit of step data per step (file or folder, by backend;
                                ``.ranks``: a folder of one file per rank, ``rank<r><suffix>``)
    RUN/steps/<unit>.partial    a unit being written; never committed
    RUN/writer.lock             held by the one process that may write (or repair)
    RUN/damaged/                units that repair could not commit, kept
    RUN/index.sqlite.rebuilding/  the new index that repair builds aside

A name taken from stored data (an index row's location, a file named in a
unit) is used only through :func:`entry_path`, which keeps it inside its folder.
"""

from __future__ import annotations

import errno
import fcntl
import operator
import os
import socket
import stat
from typing import Any

from .errors import CorruptionError, StoreLockedError

STEPS_DIR = "steps"
INDEX_FILE = "index.sqlite"
WRITER_LOCK = "writer.lock"
DAMAGED_DIR = "damaged"
REBUILDING_DIR = INDEX_FILE + ".rebuilding"  # repair builds the new index here, then renames it into place
PARTIAL = ".partial"  # a unit being written; never committed
RANKS_SUFFIX = ".ranks"  # a step's folder of one file per rank
RESTORE_PART = ".restore"  # a restore point's second unit: what its trajectory point does not keep
# The largest step: the index stores steps as SQLite INTEGER (signed 64-bit);
# the name of a step's unit (step_stem) holds any of them.
MAX_STEP = 2**63 - 1


def run_path(path: Any) -> str:
    """A run's path as a str, from a str, bytes or os.PathLike; else a TypeError naming it."""
    try:
        return os.fsdecode(os.fspath(path))
    except TypeError:
        raise TypeError(f"a run path is a str, bytes or os.PathLike, got {path!r}") from None


def integral(number: Any) -> int:
    """An int from any integral number (``int``, ``numpy.int64``, ...) but a bool."""
    if isinstance(number, bool):
        raise TypeError(f"{number!r} is a bool, not a number")
    return operator.index(number)


def count_of(value: Any, what: str) -> int:
    """``value`` as an int >= 1 (a numpy integer too), else a ValueError naming ``what``."""
    try:
        count = integral(value)
    except TypeError:
        count = 0
    if count < 1:
        raise ValueError(f"{what} needs a whole number >= 1, got {value!r}")
    return count


def asked_step(step: Any) -> int:
    """A step asked for to read: an int from any integral number (``numpy.int64`` from an
    array of steps), else a TypeError that names what was given."""
    try:
        return integral(step)
    except TypeError:
        raise TypeError(f"a step is a whole number (int), got {step!r}") from None


def steps_dir(run_dir: str) -> str:
    return os.path.join(run_dir, STEPS_DIR)


def index_path(run_dir: str) -> str:
    return os.path.join(run_dir, INDEX_FILE)


def step_stem(step: int) -> str:
    """Zero-padded so that listings sort by step."""
    return f"{step:012d}"


def unit_name(step: int, suffix: str, part: str = "") -> str:
    """The name in ``steps/`` of unit ``part`` of ``step`` (``""`` its main unit) for a
    backend whose units end in ``suffix``: ``000000000012.bp``, ``000000000012.restore.bp``."""
    name = step_stem(step) + suffix
    return restore_unit(name) if part == "restore" else name


def restore_unit(location: str) -> str:
    """The name of the restore unit beside the main unit ``location`` of a restore point
    (``000000000012.bp`` -> ``000000000012.restore.bp``)."""
    stem, dot, suffix = location.partition(".")
    return stem + RESTORE_PART + dot + suffix


def main_of_restore_unit(unit: str) -> str | None:
    """The main unit whose restore unit ``unit`` is named as (``<step>.restore<suffix>``
    -> ``<step><suffix>``), or None when ``unit`` is not so named (a main unit, or no step's)."""
    stem, _, rest = unit.partition(".")
    mark = RESTORE_PART[1:]
    if not (stem.isascii() and stem.isdigit()) or (rest != mark and not rest.startswith(mark + ".")):
        return None
    main = stem + rest[len(mark):]
    return main if restore_unit(main) == unit else None


def step_of_unit(unit: str) -> int | None:
    """The step a unit's name (``<step><suffix>``, or ``<step>.restore<suffix>``) says, or None."""
    stem = os.path.splitext(main_of_restore_unit(unit) or unit)[0]
    return int(stem) if stem.isascii() and stem.isdigit() else None


def rank_file(rank: int, suffix: str) -> str:
    """The name of rank ``rank``'s file inside a ``.ranks`` unit."""
    return f"rank{rank:05d}{suffix}"


def finished_units(run_dir: str) -> list[str]:
    """The entries of ``steps/`` that are not being written, sorted ([] without ``steps/``)."""
    try:
        entries = os.listdir(steps_dir(run_dir))
    except FileNotFoundError:
        return []
    return sorted(e for e in entries if not e.endswith(PARTIAL))


def entry_path(folder: str, name: str, what: str) -> str:
    """``folder/name`` for a ``name`` read from stored data (``what`` says whose, for
    the error): one plain name of ``folder``, and not a symbolic link, so the path
    stays inside ``folder``. A missing entry is not refused: its reader says it is missing.

    Raises:
        CorruptionError: ``name`` is not a plain name, or the entry is a symbolic link.
    """
    if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name
            or (os.altsep and os.altsep in name)):
        raise CorruptionError(f"{what} is named {name!r}, which is not a name inside {folder}: refused")
    path = os.path.join(folder, name)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    if stat.S_ISLNK(mode):
        raise CorruptionError(f"{what} ({path}) is a symbolic link; stored data is read and deleted "
                              f"only inside {folder}: refused")
    return path


def unit_bytes(path: str) -> int:
    """The bytes of the regular files of a unit (the file itself, or every file
    under the folder); symbolic links are neither followed nor counted."""
    if not os.path.isdir(path) or os.path.islink(path):
        return _file_bytes(path)
    return sum(_file_bytes(os.path.join(root, f)) for root, _dirs, files in os.walk(path) for f in files)


def _file_bytes(path: str) -> int:
    st = os.lstat(path)
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def file_not_run(run_dir: str) -> str | None:
    """Why ``run_dir`` holds no run, where it is a file (a user's slip worth naming)."""
    return "it is a file, and a run is a folder" if os.path.isfile(run_dir) else None


def take_writer_lock(run_dir: str) -> int:
    """Take the run's one writer lock (``RUN/writer.lock``, flock); its descriptor.
    Raises :class:`StoreLockedError` naming the holder."""
    path = os.path.join(run_dir, WRITER_LOCK)
    while True:
        fd = _lock_file(run_dir, path)
        if _lock_still_named(path, fd):
            break
        os.close(fd)  # the file was unlinked (an open refused) between our open and our lock: again
    os.ftruncate(fd, 0)
    os.pwrite(fd, _holder().encode(), 0)
    return fd


def _lock_still_named(path: str, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _lock_file(run_dir: str, path: str) -> int:
    """``path`` opened (created if need be) and flocked; its descriptor."""
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
        if holder == _holder():  # a writer of this very process was never closed
            raise StoreLockedError(
                f"{run_dir} is being written by a Checkpointer of this process that was not closed; "
                "one writer per run (close it first: ckpt.close(), or use it in a with block)"
            ) from None
        raise StoreLockedError(
            f"{run_dir} is being written by {holder}; one writer per run "
            "(read it with datastates_hist.open, or wait for that process to end)"
        ) from None
    return fd


def _holder() -> str:
    """How a writer lock names the process that holds it."""
    return f"pid {os.getpid()} on {socket.gethostname()}"
