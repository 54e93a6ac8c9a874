"""The backend contract: where the bytes of one step go, and how they come back.

A backend stores each step as one unit (a file or a folder) inside the run's
``steps/`` folder. Lifecycle of a write, in order, all on the flusher thread:

1. ``writer = backend.begin_step(steps_dir, step)``: creates the unit at a
   temporary name.
2. ``writer.define(name, dtype, shape, real_dtype)`` once per tensor, then
   ``writer.put(name, array, start)`` for each of its pieces. ``array`` is a
   contiguous numpy view into the host cache; it must stay untouched until
   the next ``writer.write_out()`` or ``writer.finish()`` returns.
3. ``writer.write_out()`` when the host cache needs its space back, and, if
   ``writer.write_out_early`` is true (the default), whenever a quarter of
   the cache waits to be written, so that writing overlaps the snapshot.
4. ``location = writer.finish(manifest)``: stores the manifest (bytes), makes
   every byte durable (fsync), and moves the unit to its final name.
   Only then does the index commit the step.
   ``writer.abort()`` instead removes whatever was written.

When several ranks write one step (``begin_step(steps_dir, step, group)``),
``finish`` is split: every rank calls ``writer.seal(manifest or None)`` (only
rank 0 passes the manifest; each rank makes its own bytes durable), then rank 0
alone calls ``writer.publish()`` once every rank has sealed. ``define`` then
gets ``block=(global_shape, offset)`` for a tensor that is a block of a larger
one. By default each rank writes its own file inside the step's folder
(:mod:`.ranks`); a backend may instead write one shared file collectively.

Reading: ``reader = backend.open_step(steps_dir, location)``, then
``reader.manifest()`` and ``reader.read(name, out, start, part)`` (fills the
contiguous array ``out`` with the box at ``start`` of shape ``out.shape``, in
the file of rank ``part``, or in the one shared file when ``part`` is None),
and ``reader.close()``. ``backend.remove_step(steps_dir, location)`` deletes a
step's unit (retention). A backend never touches the index. A path built from
stored data (a location, a file named in a unit) goes through :func:`entry_path`,
and nothing follows a symbolic link out of ``steps/``.
"""

from __future__ import annotations

import os
import shutil
import stat
from abc import ABC, abstractmethod

import numpy as np

from ..errors import CorruptionError


class StepWriter(ABC):
    @abstractmethod
    def define(self, name: str, dtype: np.dtype, shape: tuple[int, ...], real_dtype: str,
               block: tuple | None = None) -> None:
        """Declare tensor ``name``: stored as ``dtype`` (numpy), really ``real_dtype`` (torch name).

        ``block``: ``(global_shape, offset)`` when the tensor is that block of a
        global array; a writer of one rank's own file may ignore it (puts are
        always in the tensor's own coordinates).
        """

    @abstractmethod
    def put(self, name: str, array: np.ndarray, start: tuple[int, ...]) -> None: ...

    write_out_early = True  # False where write_out costs more than waiting (a copy)

    @abstractmethod
    def write_out(self) -> None: ...

    @abstractmethod
    def finish(self, manifest: bytes) -> str: ...

    @abstractmethod
    def abort(self) -> None: ...


class StagedStepWriter(StepWriter):
    """A writer whose unit is written at ``<final>.partial`` and renamed into place."""

    def __init__(self, final: str, clean: bool = True):
        self.final = final
        self.tmp = self.final + ".partial"
        if clean:
            remove_tree(self.tmp)  # left by a crash

    @abstractmethod
    def write_manifest(self, manifest: bytes) -> None: ...

    @abstractmethod
    def close_files(self) -> None:
        """Close what is open; after this the unit at ``self.tmp`` is complete."""

    def finish(self, manifest: bytes) -> str:
        self.seal(manifest)
        return self.publish()

    def seal(self, manifest: bytes | None) -> None:
        """Store the manifest (if given), close, and make this writer's bytes durable."""
        if manifest is not None:
            self.write_manifest(manifest)
        self.close_files()
        fsync_tree(self.tmp)

    def publish(self) -> str:
        """Rename the sealed (durable) unit into place; the location to record in the index."""
        rename_into_place(self.tmp, self.final)
        return os.path.basename(self.final)

    def abort(self) -> None:
        try:
            self.close_files()
        except Exception:
            pass  # the unit is removed anyway
        remove_tree(self.tmp)


class StepReader(ABC):
    # Whether read_many reads with several threads of its own (ADIOS2's BP5 reader does).
    # If not, a restore faults fresh destination memory in a second thread meanwhile.
    parallel_reads = False

    @abstractmethod
    def manifest(self) -> bytes: ...

    @abstractmethod
    def read(self, name: str, out: np.ndarray, start: tuple[int, ...], part: int | None = None) -> None: ...

    def read_many(self, requests: list[tuple[str, np.ndarray, tuple[int, ...]]]) -> None:
        """Several ``read(name, out, start)`` of the one shared file; a backend may batch them."""
        for name, out, start in requests:
            self.read(name, out, start)

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> "StepReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Backend(ABC):
    """A storage format for steps. Found by name through :func:`get_backend`.

    A backend gives a writer and a reader of one file (``writer_at``,
    ``reader_at``); steps of one process are one such file, steps of several
    ranks a folder of them (:mod:`.ranks`) unless the backend overrides
    ``begin_step`` to write one shared file.
    """

    name: str = ""
    suffix: str = ""

    @abstractmethod
    def writer_at(self, final: str, step: int) -> StagedStepWriter:
        """A writer of one unit of ``step`` that will be published at ``final``."""

    @abstractmethod
    def reader_at(self, path: str) -> StepReader: ...

    def begin_step(self, steps_dir: str, step: int, group=None) -> StepWriter:
        if group is None or group.size == 1:
            return self.writer_at(os.path.join(steps_dir, step_stem(step) + self.suffix), step)
        from .ranks import RankFilesWriter

        return RankFilesWriter(self, steps_dir, step, group)

    def open_step(self, steps_dir: str, location: str) -> StepReader:
        from .ranks import RANKS_SUFFIX, RankFilesReader

        path = entry_path(steps_dir, location, f"the step data {location!r}")
        if location.endswith(RANKS_SUFFIX):
            return RankFilesReader(self, path)
        return self.reader_at(path)

    def remove_step(self, steps_dir: str, location: str) -> None:
        remove_tree(entry_path(steps_dir, location, f"the step data {location!r}"))


def step_stem(step: int) -> str:
    """Zero-padded so that listings sort by step."""
    return f"{step:012d}"


def fsync_tree(path: str) -> None:
    """fsync every file under ``path`` (or the file itself), then the folders."""
    if os.path.isdir(path):
        for root, _dirs, files in os.walk(path):
            for f in files:
                fsync_path(os.path.join(root, f))
            fsync_dir(root)
    else:
        fsync_path(path)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def remove_tree(path: str) -> None:
    """Delete a file or a folder; a symbolic link is removed itself, never followed."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)  # removes links inside as links
        elif os.path.lexists(path):
            os.remove(path)
    except FileNotFoundError:
        pass  # removed meanwhile (by another rank)


def rename_into_place(tmp_path: str, final_path: str) -> None:
    """Rename the durable ``tmp_path`` to ``final_path`` atomically, and make the rename durable."""
    if os.path.exists(final_path):  # left by a crash before its step was committed
        remove_tree(final_path)
    os.rename(tmp_path, final_path)
    fsync_dir(os.path.dirname(final_path))
