"""The flush: move snapshot pieces from the host cache into a backend, then commit.

Runs on its own thread. For each piece it updates the tensor's checksum and
statistics (unless the snapshot did, for host tensors) and either puts it to the
step writer (by pointer, no copy) or, for a tensor to be encoded, compresses it
(:mod:`.deltas`) and puts the tensor's encoded bytes once its last piece is in
(a tensor rounded to ``keep_bits`` puts its rounded value in the main unit, its low
bits in the restore unit).
A restore point written as two units has a writer for each. The cache
space is given back after the writer has written it out: when the snapshot
asks for space, or when the step is finished. At the end of a checkpoint,
the committer (:mod:`commit`) makes the data durable and then records the step
in the index. Any failure marks the checkpoint failed; it is raised to the
training loop at its next ``write()``, ``wait()`` or ``close()``.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from typing import Callable

import numpy as np

from . import predictors
from .cache import HostCache
from .rounding import MantissaSplit, rounding_bound
from .deltas import Anchors, Encoding
from .digest import Digest
from .dtypes import dtype_name, storage_dtype
from .items import RAW, TensorRecord
from .snapshot import Begin, End, Message, NeedSpace, PendingCheckpoint, Piece, Pieces, Stop


# When the flush falls behind training (the host cache is full past a fraction of it and
# holds a later step's snapshot, or training waits for a snapshot), tensors are stored raw
# until it catches up, and a tensor already begun stores its remaining chunks uncompressed:
# an encoder slower than training then costs what writing the bytes costs, not a wait.
# Once training has waited for a snapshot that waited for cache space, whole steps are
# stored raw until a snapshot fits the cache without waiting.
# ``keep_up=None`` (the default) switches only when the cache is nearly full, the moment
# before the next snapshot, and training with it, would wait; ``keep_up=True`` switches at
# half and also runs the flush at the lowest priority (nice 19), so encoding and writing
# use the CPU time training leaves; ``keep_up=False`` encodes however far behind. The nice
# level alone only moved work to the drain at close() (small GPT, 2 cores: step time -5
# to -10%, step time with the drain +0 to +7%), so it comes with ``keep_up=True`` only.
FLUSH_NICE = 19
BEHIND_FRACTION = {None: 0.9, True: 0.5}


def _yield_cpu() -> None:
    """Lower the calling thread's priority to :data:`FLUSH_NICE` (Linux: per thread);
    threads it starts (a backend's) inherit it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), FLUSH_NICE)
    except (AttributeError, OSError):  # no per-thread priority here: run as training does
        pass


class _Step:
    """Flush state of one checkpoint."""

    def __init__(self, ckpt: PendingCheckpoint):
        self.ckpt = ckpt
        self.writers: dict = {}  # unit ("" main, "restore") -> its StepWriter
        self.digests: dict[int, Digest] = {}
        self.encodings: dict[int, Encoding] = {}
        self.records: list[TensorRecord] = []
        self.kept_regions: set[int] = set()  # ids of regions a writer reads until write_out

    def writer(self, index: int):
        plan = self.ckpt.plan
        return self.writers[plan.part(self.ckpt.tensors[index].name) if plan is not None else ""]


class Flusher:
    """The flusher thread. ``committer`` (:class:`commit.Committer`) opens each step's
    writer and commits it, so that this module knows no backend or index. It is asked to
    commit failed checkpoints too (it does not commit them): with several ranks, the
    ranks agree on every step's outcome."""

    def __init__(self, cache: HostCache, committer, refuse_nonfinite: bool = False, key_every: int = 16,
                 keep_up: bool | None = None, training_waits: threading.Event | None = None,
                 commit_waits: threading.Event | None = None):
        self.cache = cache
        self.keep_up = keep_up
        # set while the training thread waits for a snapshot (the pipeline's hooks)
        self.training_waits = training_waits or threading.Event()
        self.commit_waits = commit_waits or threading.Event()  # training waits in write() for a commit
        self.behind_bytes = None if keep_up is False else BEHIND_FRACTION[keep_up] * cache.capacity
        self.raw_to_keep_up = 0  # tensors stored raw, not encoded, because the flush was behind
        # the flush holds training back: a step's snapshot waited for cache space and training
        # for that snapshot (a step larger than the cache, or a backlog that fills it), and
        # every snapshot since has waited for space too (raw steps may not make training wait:
        # it stays set until a snapshot fits, not to alternate raw and encoded steps)
        self._held_training = False
        self.refuse_nonfinite = refuse_nonfinite
        self.committer = committer
        self.anchors = Anchors(key_every)
        self.inbox: queue.Queue[Message] = queue.Queue()
        self.unwritten: list = []  # regions (and encoded bytes) put to the writers, not yet written out
        self.unwritten_bytes = 0
        self.flush_seconds = 0.0
        # set when the thread is done (Thread.join() interrupted by Ctrl-C may leave the
        # thread marked as stopped while it runs: CPython 3.11, bpo-45274's fix)
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dh-flush", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            self.ended.set()

    def _serve(self) -> None:
        if self.keep_up is True:
            _yield_cpu()
        current: _Step | None = None
        while True:
            msg = self.inbox.get()
            if isinstance(msg, Stop):
                return
            t0 = time.perf_counter()
            try:
                current = self._handle(msg, current)
            except BaseException as exc:  # never let the thread die: fail the step instead
                if current is not None:
                    current.ckpt.fail(exc)
            self.flush_seconds += time.perf_counter() - t0

    def _handle(self, msg: Message, current: "_Step | None") -> "_Step | None":
        match msg:
            case Begin(ckpt):
                current = _Step(ckpt)
                self._guard(current, lambda: current.writers.update(self.committer.open_writers(ckpt)))
            case Pieces(pieces):
                for piece in pieces:
                    if current.ckpt.error is None:
                        self._guard(current, lambda: self._put(current, piece))
                    if current.ckpt.error is not None:
                        self._release()
                        if piece.region is not None and piece.owner:
                            self.cache.free(piece.region)
            case NeedSpace():
                if current is not None and current.ckpt.error is None:
                    self._guard(current, lambda: self._write_out(current))
                self._release()
            case End():
                ckpt = current.ckpt
                self._held_training = ckpt.waited_for_space and (ckpt.training_waited or self._held_training)
                self._finish(current)
                current = None
        return current

    def _guard(self, step: _Step, fn: Callable) -> None:
        try:
            fn()
        except BaseException as exc:
            step.ckpt.fail(exc)

    def _release(self) -> None:
        """Give back the regions already written out (or abandoned on failure)."""
        for region in self.unwritten:
            if not isinstance(region, np.ndarray):  # encoded bytes are let go
                self.cache.free(region)
        self.unwritten.clear()
        self.unwritten_bytes = 0

    def _write_out(self, step: _Step) -> None:
        for writer in step.writers.values():
            writer.write_out()

    def _hold(self, step: _Step, held, nbytes: int, writer) -> None:
        """Keep ``held`` (a cache region or encoded bytes put to ``writer``) until written out."""
        self.unwritten.append(held)
        self.unwritten_bytes += nbytes
        if self.unwritten_bytes * 4 >= self.cache.capacity and writer.write_out_early:
            self._write_out(step)  # the snapshot fills the rest of the cache meanwhile
            self._release()

    def _begin_tensor(self, step: _Step, index: int, piece: Piece) -> None:
        item = step.ckpt.tensors[index]
        t = item.tensor
        # a host tensor's digest comes with its pieces: the snapshot adds them as it copies
        step.digests[index] = piece.digest or Digest()
        nbytes = t.numel() * storage_dtype(t.dtype).itemsize
        plan = step.ckpt.plan
        if plan is not None and nbytes and item.global_shape is None:
            dtype = dtype_name(t.dtype)
            keep_bits = plan.keep_bits(item.name, dtype)
            encodes = plan.encodes(item.name)
            if keep_bits is None and encodes and self._behind(step.ckpt):
                self.raw_to_keep_up += 1  # its anchor stays: the next step's delta is against that
            elif encodes or keep_bits is not None:  # a rounded value is encoded, as a key at least
                encoding = step.encodings[index] = self.anchors.begin(
                    item.name, dtype, nbytes, step.ckpt.step, plan.may_delta(item.name), plan.anchor, keep_bits)
                # predicted from a tensor of the same unit only: one kept as long as it is
                if item.predictor is not None and all(plan.part(name) == plan.part(item.name)
                                                      for _, name in predictors.dependencies(item.predictor, 0, 0)):
                    self.anchors.predict(encoding, item.predictor)
                return  # defined once its encoded size is known
        block = {} if item.global_shape is None else {"block": (item.global_shape, item.offset)}
        step.writer(index).define(item.name, storage_dtype(t.dtype), tuple(t.shape), dtype_name(t.dtype), **block)

    def _behind(self, ckpt: PendingCheckpoint) -> bool:
        """Whether the flush has fallen behind training: it holds training back (every
        snapshot has waited for cache space since one that training waited for: training
        will wait again, and what the flush encodes until then shares the CPU with
        training's compute), or the cache is more than :data:`BEHIND_FRACTION` full (once
        full, the snapshot waits for the flush) and it holds a later step's snapshot, or
        training waits for a snapshot now (a step larger than the cache: its own snapshot
        waits for space). A step that is most of the cache fills it while the flush keeps
        up: encoded, unless training waits for it."""
        if self.behind_bytes is None:
            return False
        if self._held_training:
            return True
        if self.keep_up is True and self.commit_waits.is_set():
            return True  # training waits for the oldest commit (max_steps_in_flight): give way, as asked
        if self.cache.held_bytes() <= self.behind_bytes:
            return False
        later = ckpt.cache_end is not None and self.cache.allocated != ckpt.cache_end
        return later or self.training_waits.is_set()

    def _put(self, step: _Step, piece: Piece) -> None:
        item = step.ckpt.tensors[piece.index]
        t = item.tensor
        sdtype = storage_dtype(t.dtype)
        if piece.index not in step.digests:
            self._begin_tensor(step, piece.index, piece)
        digest = step.digests[piece.index]
        encoding = step.encodings.get(piece.index)
        writer = step.writer(piece.index)
        if piece.data is not None or piece.region is not None:
            if piece.data is not None:  # an immutable tensor's piece, in its own memory
                raw = piece.data
            else:
                if piece.copied is not None:
                    piece.copied.synchronize()
                raw = self.cache.array(piece.region)
                if not piece.owner or piece.at:  # one of several small tensors in the region
                    raw = raw[piece.at:piece.at + max(math.prod(piece.count), 1) * sdtype.itemsize]
            array = raw.view(sdtype).reshape(piece.count)
            if piece.digest is None:
                digest.update(array, t.dtype)
            if encoding is not None:  # consumed: compressed, and copied if an anchor
                # a tensor begun while the flush kept up: its later pieces give way alike
                encoding.add(raw.reshape(-1), compress=encoding.lossy is not None or not self._behind(step.ckpt))
            else:
                writer.put(item.name, array, piece.start)
                if not writer.writes_at_put:  # held until written out
                    if piece.data is not None:
                        self._hold(step, raw, raw.size, writer)
                    else:
                        step.kept_regions.add(id(piece.region))
            if piece.region is not None and piece.owner:  # the region's last piece
                if id(piece.region) in step.kept_regions:
                    step.kept_regions.discard(id(piece.region))
                    self._hold(step, piece.region, piece.region.nbytes, writer)
                else:
                    self.cache.free(piece.region)
        if piece.last:
            stats = digest.stats()
            if self.refuse_nonfinite and stats["nonfinite"]:
                raise ValueError(
                    f"tensor {item.name!r} holds {stats['nonfinite']} NaN or infinite value(s); "
                    "refused because refuse_nonfinite=True"
                )
            record = TensorRecord(
                item.name, dtype_name(t.dtype), tuple(t.shape),
                t.numel() * sdtype.itemsize, digest.checksum(), RAW, stats,
                item.global_shape, item.offset,
                part=step.ckpt.plan.part(item.name) if step.ckpt.plan is not None else "",
                distribution=digest.distribution(),
            )
            if encoding is not None:
                self._put_encoded(step, record, encoding, writer)
            step.records.append(record)

    def _put_encoded(self, step: _Step, record: TensorRecord, encoding: Encoding, writer) -> None:
        blob, chunks, ratio = encoding.finish()
        writer.define(record.name, np.dtype(np.uint8), (blob.size,), "uint8")
        writer.put(record.name, blob, (0,))
        if not writer.writes_at_put:
            self._hold(step, blob, blob.size, writer)
        record.encoding, record.stored, record.chunks, record.update_ratio = encoding.kind, blob.size, chunks, ratio
        if encoding.base is not None:
            record.base = encoding.base.step
        if encoding.base2 is not None:
            record.base2 = encoding.base2.step
        if encoding.prediction is not None:
            record.predictor = encoding.prediction.predictor
        if encoding.lossy is not None:
            self._put_low_bits(step, record, encoding.lossy)

    def _put_low_bits(self, step: _Step, record: TensorRecord, lossy: MantissaSplit) -> None:
        """A rounded tensor's low bits go to the restore unit, under its name; its record
        says how it was rounded, and checks both values: ``checksum`` the rounded bytes
        the main unit holds, ``exact_checksum`` the bytes written (the digest's)."""
        blob, chunks = lossy.finish()
        writer = step.writers["restore"]
        writer.define(record.name, np.dtype(np.uint8), (blob.size,), "uint8")
        writer.put(record.name, blob, (0,))
        if not writer.writes_at_put:
            self._hold(step, blob, blob.size, writer)
        record.keep_bits, record.bound = lossy.keep_bits, rounding_bound(record.dtype, lossy.keep_bits)
        record.exact_checksum, record.checksum = record.checksum, lossy.checksum()
        record.low_stored, record.low_chunks = blob.size, chunks

    def _finish(self, step: _Step) -> None:
        ckpt = step.ckpt
        try:
            self.committer.commit(ckpt, step.writers, step.records)  # also on failure: ranks decide together
        except BaseException as exc:
            ckpt.fail(exc)
        finally:
            if ckpt.error is not None:
                self.anchors.forget()
                for writer in step.writers.values():
                    try:
                        writer.abort()
                    except BaseException:
                        pass
            else:
                self.anchors.committed()
                self.anchors.drop(self.committer.removed)  # by retention just now
            self._release()
            ckpt.snapshot_done.set()  # a snapshot of tensors handed on in their own memory ends here
            ckpt.done.set()
