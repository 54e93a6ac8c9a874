"""ADIOS2 BP5 backend: one BP5 file (a folder) per step, written through the C API.

Each tensor is a global array variable with the same name every step; a
tensor streamed through the host cache in pieces is written as several blocks
of that array. Scalars are stored with shape ``(1,)``; zero-size tensors are
recorded in the manifest only. The manifest is the uint8 variable
``__manifest__``.

A checkpoint is one ADIOS2 step, unless the host cache fills up before it is
written: a writer of its own file then ends the ADIOS2 step, which writes the
blocks put so far straight from the cache, and goes on in the next one (a
handful of steps per checkpoint larger than the cache). A tensor whose blocks
lie in several ADIOS2 steps is listed, with its blocks' steps, in the JSON
variable ``__blocks__``; every other variable is read from the step it first
appears in.
"""

from __future__ import annotations

import json
import os

import numpy as np

from ..boxes import overlap
from ..durable import fsync_tree, remove_tree
from ..layout import PARTIAL, unit_name
from . import _adios2_capi as capi
from ._stderr import stderr_kept
from .base import Backend, StagedStepWriter
from .bp5_files import PROFILE, check_checksums, write_checksums
from .step import StepReader

MANIFEST = "__manifest__"
BLOCKS = "__blocks__"
SUFFIX = ".bp"

# Measured choices (docs/performance.md): the flusher thread itself does the
# I/O (ctypes drops the GIL), so no AsyncWrite.
WRITE_PARAMETERS = {"AsyncWrite": "off", "StatsLevel": "0", "MinDeferredSize": "1"}


def _file_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(shape) if len(shape) else (1,)


def _file_start(start: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(start) if len(start) else (0,)


class Adios2StepWriter(StagedStepWriter):
    """One BP5 file of one step, written by this process alone."""

    def __init__(self, final: str, parameters: dict[str, str], comm=None):
        root = comm is None or comm.Get_rank() == 0
        try:
            super().__init__(final, clean=root)  # rank 0 removes what a crash left
        except Exception as exc:
            failed = exc
        else:
            failed = None
        # the ranks learn whether rank 0 could, before the collective calls below
        if (comm.allreduce(int(failed is not None)) if comm is not None else failed is not None):
            raise failed or RuntimeError(f"rank 0 could not remove {final}{PARTIAL}, left by a crash")
        self.root = root
        self.adios = capi.Adios(comm)
        try:
            self.file = capi.FileWriter(self.adios, self.tmp, parameters)
        except BaseException:
            self.adios.close()
            if root:  # the room refused on a full disk, or ADIOS2 could not open: nothing left behind
                self.remove()
            raise
        self.substep = 0  # the ADIOS2 step being written
        self.blocks: dict[str, list] = {}  # name -> [[substep, start, count], ...]
        self.unwritten = False  # blocks put in this ADIOS2 step
        self.kept: list[bytes] = []

    def define(self, name, dtype, shape, real_dtype, block=None):
        if 0 not in shape:
            self.file.define(name, np.dtype(dtype), _file_shape(shape))

    def put(self, name, array, start):
        if array.size == 0:
            return
        assert array.flags.c_contiguous
        count = _file_shape(array.shape)
        self.file.put(name, array.ctypes.data, _file_start(start), count)
        self.blocks.setdefault(name, []).append([self.substep, list(_file_start(start)), list(count)])
        self.unwritten = True

    def write_out(self):
        # Ending the ADIOS2 step writes the blocks from the cache as they are; PerformPuts
        # (what a mid-step write needs) would first copy them into fresh buffers: 2-3x slower.
        if self.unwritten:
            self.file.next_step()
            self.substep += 1
            self.unwritten = False

    def _put_bytes(self, name: str, data: bytes) -> None:
        self.kept.append(data)  # put by pointer: alive until the file is closed
        raw = np.frombuffer(data, dtype=np.uint8)
        self.file.define(name, raw.dtype, raw.shape)
        self.file.put(name, raw.ctypes.data, (0,), raw.shape)

    def write_manifest(self, manifest: bytes) -> None:
        split = {name: blocks for name, blocks in self.blocks.items()
                 if len({b[0] for b in blocks}) > 1}
        if split:
            self._put_bytes(BLOCKS, json.dumps(split, separators=(",", ":")).encode())
        self._put_bytes(MANIFEST, manifest)

    def close_files(self):
        try:
            self.file.close()
        finally:
            self.adios.close()
        if self.root:
            remove_tree(os.path.join(self.tmp, PROFILE))
            write_checksums(self.tmp)


class Adios2CollectiveWriter(Adios2StepWriter):
    """One BP5 file of one step, written by every rank of an MPI communicator.

    Each tensor is a global array; each rank puts its blocks at their offsets,
    and ADIOS2 aggregates them into a few subfiles (``NumAggregators``,
    ``AggregationType``) with one metadata index. Opening, ending the step and
    closing are collective.
    """

    shared = True
    write_out_early = False  # its write_out copies the blocks: only when the cache is full

    def __init__(self, final: str, parameters: dict[str, str], comm):
        super().__init__(final, parameters, comm)
        self.offsets: dict[str, tuple[int, ...]] = {}

    def define(self, name, dtype, shape, real_dtype, block=None):
        if block is None:
            return super().define(name, dtype, shape, real_dtype)
        global_shape, offset = block
        self.offsets[name] = tuple(offset)
        super().define(name, dtype, tuple(global_shape), real_dtype)

    def put(self, name, array, start):
        offset = self.offsets.get(name)
        if offset is not None:
            start = tuple(o + s for o, s in zip(offset, start))
        super().put(name, array, start)

    def write_out(self):
        # Ending a step is collective and ranks ask for space at different times:
        # hand the blocks to ADIOS2's own buffers instead (a local copy).
        self.file.perform_puts()

    def seal(self, manifest):
        try:
            if manifest is not None:
                self.write_manifest(manifest)
        finally:
            self.close_files()  # collective: every rank closes, even where the manifest failed
        if self.root:
            fsync_tree(self.tmp)

    def abort(self):
        try:
            self.close_files()  # collective: every rank aborts together
        except Exception:
            pass

    def abandon(self):
        # Finalizing the context destroys the engine without its collective close: BP5's
        # destructor only clears the index's "active" byte and closes the files, locally.
        # Its warning that the output may be corrupt is kept off stderr: the step is failed.
        self.file.engine = None
        with stderr_kept([]):
            self.adios.close()


class Adios2StepReader(StepReader):
    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"step data {path} is missing")
        self.sizes = check_checksums(path)
        self.path = path
        self.adios = capi.Adios()
        self.file = None
        try:  # a reader that fails here is released at once, never left to the end of the process
            self.file = capi.FileReader(self.adios, path)
            self.split = self._split_tensors()
        except BaseException:
            self.close()
            raise

    def _split_tensors(self) -> dict[str, list]:
        try:
            split = json.loads(self._bytes(BLOCKS))
        except KeyError:  # every variable in one ADIOS2 step
            return {}
        out = {}
        for name, blocks in split.items():
            # reads select a variable's steps counting only those it was written in
            steps = sorted({b[0] for b in blocks})
            out[name] = [(steps.index(step), start, count) for step, start, count in blocks]
        return out

    def _bytes(self, name: str) -> bytes:
        (n,) = self.file.shape(name)
        stored = sum(size for f, size in self.sizes.items() if f.startswith("data."))
        if n > stored:  # checked before the memory is asked for
            raise ValueError(f"{name} of {self.path} declares {n} bytes, more than the {stored} bytes of its data")
        out = np.empty(n, dtype=np.uint8)
        self.file.get(name, out.ctypes.data, (0,), (n,))
        return out.tobytes()

    def manifest(self) -> bytes:
        return self._bytes(MANIFEST)

    def read(self, name, out, start, part=None):
        self.read_many([(name, out, start)])

    def read_many(self, requests):
        """Every ``(name, out, start)`` read in one ``PerformGets``: ADIOS2 then plans
        the reads of all the tensors together."""
        for name, out, start in requests:
            if out.size:
                assert out.flags.c_contiguous and out.flags.writeable
                if name in self.split:
                    self._read_split(name, out, start)
                else:
                    self.file.get(name, out.ctypes.data, _file_start(start), _file_shape(out.shape),
                                  deferred=True)
        self.file.perform_gets()

    def _read_split(self, name, out, start):
        """Read a box of a tensor whose blocks lie in several ADIOS2 steps, block by block."""
        view = out.reshape(_file_shape(out.shape))
        lo = _file_start(start)
        for step, bstart, bcount in self.split[name]:
            common = overlap(lo, view.shape, bstart, bcount)
            if common is None:
                continue
            a, b = common
            dst = view[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, lo))]
            part = dst if dst.flags.c_contiguous else np.empty(dst.shape, dtype=dst.dtype)
            count = tuple(y - x for x, y in zip(a, b))
            self.file.get(name, part.ctypes.data, a, count, step=step)
            if part is not dst:
                dst[...] = part

    def close(self):
        try:
            if self.file is not None:
                self.file.close()
        finally:
            self.adios.close()


def collective_defaults(group) -> dict[str, str]:
    """Aggregation of collective writes, measured (docs/performance.md): each
    aggregator writes its own subfile directly (``EveryoneWrites``), up to 4
    per node; ADIOS2's default (one aggregator per node, gathering the others'
    data through shared memory) was 2 to 3 times slower on 2 and 4 ranks."""
    per_node = min(getattr(group, "ranks_per_node", group.size), 4)
    return {"AggregationType": "EveryoneWrites",
            "NumAggregators": str(max(1, getattr(group, "nodes", 1) * per_node))}


class Adios2Backend(Backend):
    """BP5 files through ``libadios2_c`` (GIL released during I/O)."""

    name = "adios2"
    suffix = SUFFIX

    def __init__(self, parameters: dict[str, str] | None = None):
        """``parameters``: BP5 engine parameters over the defaults, such as
        ``NumAggregators`` or ``AggregationType`` for collective writes."""
        capi.library()  # fail early, with a clear message, when adios2 is missing
        self.parameters = {**WRITE_PARAMETERS, **(parameters or {})}

    def writer_at(self, final, step):
        return Adios2StepWriter(final, self.parameters)

    def reader_at(self, path):
        return Adios2StepReader(path)

    def begin_step(self, steps_dir, step, group=None, part=""):
        if group is not None and group.size > 1 and group.mpi_comm is not None and not part:
            final = os.path.join(steps_dir, unit_name(step, SUFFIX))
            return Adios2CollectiveWriter(final, {**collective_defaults(group), **self.parameters}, group.mpi_comm)
        return super().begin_step(steps_dir, step, group, part)
