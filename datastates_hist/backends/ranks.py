"""A step written by several ranks, each into its own file: ``steps/<step>.ranks/``.

Used where ranks cannot share one file (h5py is serial; a ``torch.distributed``
job has no MPI for ADIOS2): rank ``r`` writes ``rank<r><suffix>`` with the
backend's ordinary one-file writer, holding its blocks in their own
coordinates. Rank 0's file also holds the step's manifest, whose records say
which rank's file holds each block. The folder is written at
``<step>.ranks.partial`` and renamed by rank 0 once every rank has sealed its
file, so a step's folder is complete or absent.
"""

from __future__ import annotations

import os

from ..durable import remove_tree, rename_into_place
from ..layout import PARTIAL, RANKS_SUFFIX, entry_path, rank_file, step_stem
from .step import StepReader, StepWriter


class RankFilesWriter(StepWriter):
    def __init__(self, backend, steps_dir: str, step: int, group):
        self.final = os.path.join(steps_dir, step_stem(step) + RANKS_SUFFIX)
        self.tmp = self.final + PARTIAL
        os.makedirs(self.tmp, exist_ok=True)
        self.files = [rank_file(rank, backend.suffix) for rank in range(group.size)]
        self.file = backend.writer_at(os.path.join(self.tmp, self.files[group.rank]), step)

    @property
    def writes_at_put(self) -> bool:
        return self.file.writes_at_put

    def define(self, name, dtype, shape, real_dtype, block=None):
        self.file.define(name, dtype, shape, real_dtype)

    def put(self, name, array, start):
        self.file.put(name, array, start)

    def write_out(self):
        self.file.write_out()

    def seal(self, manifest: bytes | None) -> None:
        self.file.seal(manifest)
        self.file.publish()  # its final name inside the folder, which is still partial

    def publish(self) -> str:
        # every rank sealed (fsynced) its file and its rename: into this folder, unless a rank
        # was given another run directory (one not shared, or another path)
        missing = [name for name in self.files if not os.path.exists(os.path.join(self.tmp, name))]
        if missing:
            raise FileNotFoundError(
                f"the ranks' files {', '.join(missing)} of this step are not in {self.tmp}: every rank "
                "must write to the same run directory, on storage they all share")
        rename_into_place(self.tmp, self.final)
        return os.path.basename(self.final)

    def finish(self, manifest: bytes) -> str:
        raise RuntimeError("a step of several ranks is committed by seal() on every rank, then publish()")

    def abort(self) -> None:
        self.file.abort()

    def remove(self) -> None:
        remove_tree(self.tmp)  # the step's folder, with every rank's file


class RankFilesReader(StepReader):
    def __init__(self, backend, path: str):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"step data {path} is missing")
        self.backend, self.path = backend, path
        self.files: dict[int, StepReader] = {}

    def _file(self, rank: int) -> StepReader:
        if rank not in self.files:
            path = entry_path(self.path, rank_file(rank, self.backend.suffix), f"the file of rank {rank}")
            self.files[rank] = self.backend.reader_at(path)
        return self.files[rank]

    def manifest(self) -> bytes:
        return self._file(0).manifest()

    def read(self, name, out, start, part=None):
        if not isinstance(part, int) or part < 0:
            raise ValueError(f"a block of {name!r} names no rank's file (part {part!r})")
        self._file(part).read(name, out, start)

    def close(self):
        for f in self.files.values():
            f.close()
        self.files.clear()
