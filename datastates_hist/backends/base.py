"""The backend contract: where the bytes of one step go, and how they come back.

A backend stores each step as one unit (a file or a folder) inside the run's
``steps/`` folder. Lifecycle of a write, in order, all on the flusher thread:

1. ``writer = backend.begin_step(steps_dir, step)``: creates the unit at a
   temporary name. A restore point of two units has a second writer,
   ``backend.begin_step(steps_dir, step, part="restore")``, whose unit is
   published first.
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
alone calls ``writer.publish()`` once every rank has sealed. If any rank
failed, every rank calls ``writer.abort()`` instead (``writer.abandon()`` when
some rank has no writer to abort with), and rank 0 then ``writer.remove()``.
``define`` then gets ``block=(global_shape, offset)`` for a tensor that is a
block of a larger one. By default each rank writes its own
file inside the step's folder (:mod:`.ranks`); a backend may instead write one
shared file collectively, and its writer says so with ``shared = True``.

Reading: ``reader = backend.open_step(steps_dir, location)``, then
``reader.manifest()`` and ``reader.read(name, out, start, part)`` (fills the
contiguous array ``out`` with the box at ``start`` of shape ``out.shape``, in
the file of rank ``part``, or in the one shared file when ``part`` is None),
and ``reader.close()``. ``backend.remove_step(steps_dir, location)`` deletes a
step's unit (retention). A backend never touches the index. A path built from
stored data (a location, a file named in a unit) goes through
:func:`datastates_hist.layout.entry_path`,
and nothing follows a symbolic link out of ``steps/``.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

from ..durable import fsync_tree, remove_tree, rename_into_place
from ..layout import PARTIAL, RANKS_SUFFIX, entry_path, unit_name
from .ranks import RankFilesReader, RankFilesWriter
from .step import StepReader, StepWriter


class StagedStepWriter(StepWriter):
    """A writer whose unit is written at ``<final>.partial`` and renamed into place."""

    def __init__(self, final: str, clean: bool = True):
        self.final = final
        self.tmp = self.final + PARTIAL
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
        if manifest is not None:
            self.write_manifest(manifest)
        self.close_files()
        fsync_tree(self.tmp)

    def publish(self) -> str:
        rename_into_place(self.tmp, self.final)
        return os.path.basename(self.final)

    def abort(self) -> None:
        try:
            self.close_files()
        except Exception:
            pass  # the unit is removed anyway
        remove_tree(self.tmp)

    def remove(self) -> None:
        remove_tree(self.tmp)


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

    def begin_step(self, steps_dir: str, step: int, group=None, part: str = "") -> StepWriter:
        """The writer of unit ``part`` of ``step`` (``""`` the main unit, ``"restore"`` a
        restore point's restore unit), written by this process or by every rank of ``group``."""
        several = group is not None and group.size > 1
        if part:
            if several:
                raise ValueError("a step of several ranks is one unit: it has no restore unit")
            return self.writer_at(os.path.join(steps_dir, unit_name(step, self.suffix, part)), step)
        if not several:
            return self.writer_at(os.path.join(steps_dir, unit_name(step, self.suffix)), step)
        return RankFilesWriter(self, steps_dir, step, group)

    def open_step(self, steps_dir: str, location: str) -> StepReader:
        path = entry_path(steps_dir, location, f"the step data {location!r}")
        if location.endswith(RANKS_SUFFIX):
            return RankFilesReader(self, path)
        return self.reader_at(path)

    def remove_step(self, steps_dir: str, location: str) -> None:
        remove_tree(entry_path(steps_dir, location, f"the step data {location!r}"))

