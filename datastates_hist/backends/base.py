"""The backend contract: where the bytes of one step go, and how they come back.

A backend stores each step as one unit (a file or a folder) inside the run's
``steps/`` folder. Lifecycle of a write, in order, all on the flusher thread:

1. ``writer = backend.begin_step(steps_dir, step)``: creates the unit at a
   temporary name.
2. ``writer.define(name, dtype, shape, real_dtype)`` once per tensor, then
   ``writer.put(name, array, start)`` for each of its pieces. ``array`` is a
   contiguous numpy view into the host cache; it must stay untouched until
   the next ``writer.write_out()`` or ``writer.finish()`` returns.
3. ``writer.write_out()`` when the host cache needs its space back.
4. ``location = writer.finish(manifest)``: stores the manifest (bytes), makes
   every byte durable (fsync), and moves the unit to its final name.
   Only then does the index commit the step.
   ``writer.abort()`` instead removes whatever was written.

Reading: ``reader = backend.open_step(steps_dir, location)``, then
``reader.manifest()`` and ``reader.read(name, out, start)`` (fills the
contiguous array ``out`` with the box at ``start`` of shape ``out.shape``),
and ``reader.close()``. ``backend.remove_step(steps_dir, location)`` deletes a
step's unit (retention). A backend never touches the index.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

import numpy as np


class StepWriter(ABC):
    @abstractmethod
    def define(self, name: str, dtype: np.dtype, shape: tuple[int, ...], real_dtype: str) -> None:
        """Declare tensor ``name``: stored as ``dtype`` (numpy), really ``real_dtype`` (torch name)."""

    @abstractmethod
    def put(self, name: str, array: np.ndarray, start: tuple[int, ...]) -> None: ...

    @abstractmethod
    def write_out(self) -> None: ...

    @abstractmethod
    def finish(self, manifest: bytes) -> str: ...

    @abstractmethod
    def abort(self) -> None: ...


class StagedStepWriter(StepWriter):
    """A writer whose unit is written at ``<final>.partial`` and renamed into place."""

    def __init__(self, steps_dir: str, step: int, suffix: str):
        self.step = step
        self.final = os.path.join(steps_dir, step_stem(step) + suffix)
        self.tmp = self.final + ".partial"
        remove_tree(self.tmp)  # left by a crash

    @abstractmethod
    def close_files(self) -> None:
        """Close what is open; after this the unit at ``self.tmp`` is complete."""

    def publish(self) -> str:
        """Close, make durable, rename into place; the location to record in the index."""
        self.close_files()
        publish(self.tmp, self.final)
        return os.path.basename(self.final)

    def abort(self) -> None:
        try:
            self.close_files()
        except Exception:
            pass  # the unit is removed anyway
        remove_tree(self.tmp)


class StepReader(ABC):
    @abstractmethod
    def manifest(self) -> bytes: ...

    @abstractmethod
    def read(self, name: str, out: np.ndarray, start: tuple[int, ...]) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> "StepReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Backend(ABC):
    """A storage format for steps. Found by name through :func:`get_backend`."""

    name: str = ""

    @abstractmethod
    def begin_step(self, steps_dir: str, step: int) -> StepWriter: ...

    @abstractmethod
    def open_step(self, steps_dir: str, location: str) -> StepReader: ...

    def remove_step(self, steps_dir: str, location: str) -> None:
        remove_tree(os.path.join(steps_dir, location))


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


def remove_tree(path: str) -> None:
    import shutil

    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=False)
    elif os.path.exists(path):
        os.remove(path)


def publish(tmp_path: str, final_path: str) -> None:
    """Make ``tmp_path`` durable and rename it to ``final_path`` atomically."""
    fsync_tree(tmp_path)
    if os.path.exists(final_path):  # left by a crash before its step was committed
        remove_tree(final_path)
    os.rename(tmp_path, final_path)
    fsync_dir(os.path.dirname(final_path))
