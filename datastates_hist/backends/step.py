"""The writer and the reader of one step's unit: the two halves of the backend contract
whose lifecycle :mod:`.base` describes."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class StepWriter(ABC):
    # True when the ranks of a step write ONE shared file collectively (each block at
    # its offset in the global array, as the ADIOS2 MPI writer does); False for a file
    # per rank or a single process (blocks stored in their own coordinates).
    shared: bool = False

    write_out_early = True  # False where write_out costs more than waiting (a copy)
    # True where put() has stored the array when it returns (HDF5): the flusher then
    # reuses its memory at once instead of keeping it until write_out()
    writes_at_put = False

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

    @abstractmethod
    def write_out(self) -> None: ...

    @abstractmethod
    def finish(self, manifest: bytes) -> str:
        """One process: ``seal(manifest)`` then ``publish()``; the location to record in the index."""

    @abstractmethod
    def abort(self) -> None:
        """Stop writing and remove what this writer wrote (every rank, on a failure)."""

    # A step of several ranks: ``finish`` split in two, and the removal after a failure.
    # Writers of one process's steps need not have them (StagedStepWriter does).

    def seal(self, manifest: bytes | None) -> None:
        """Store the manifest (if given: rank 0 only), close, and make this rank's bytes durable."""
        raise NotImplementedError(f"{type(self).__name__} does not write steps of several ranks")

    def publish(self) -> str:
        """Rank 0, once every rank has sealed: move the unit to its final name (durably);
        the location to record in the index."""
        raise NotImplementedError(f"{type(self).__name__} does not write steps of several ranks")

    def remove(self) -> None:
        """Rank 0, after every rank aborted: remove what is left of the step's unit."""
        raise NotImplementedError(f"{type(self).__name__} does not write steps of several ranks")

    def abandon(self) -> None:
        """Stop writing without the other ranks: some rank has no writer of this step (its
        open failed), so a collective close would wait for it forever. A writer that closes
        alone aborts as usual; rank 0 then removes the unit."""
        self.abort()


class StepReader(ABC):
    @abstractmethod
    def manifest(self) -> bytes: ...

    @abstractmethod
    def read(self, name: str, out: np.ndarray, start: tuple[int, ...], part: int | None = None) -> None: ...

    def read_many(self, requests: list[tuple[str, np.ndarray, tuple[int, ...]]]) -> None:
        """Several ``read(name, out, start)`` of the one shared file; a backend may batch them."""
        for name, out, start in requests:
            self.read(name, out, start)

    def mapped_bytes(self, requests: list[tuple[str, int]]) -> dict[str, np.ndarray]:
        """Read-only views of whole one-dimensional uint8 datasets ``(name, nbytes)``,
        for those whose bytes the backend can map from the file instead of copying them;
        the others are read with :meth:`read_many`. A view stays valid after :meth:`close`."""
        return {}

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> "StepReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
