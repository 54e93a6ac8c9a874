"""The flush: move snapshot pieces from the host cache into a backend, then commit.

Runs on its own thread. For each piece it updates the tensor's checksum and
statistics (unless the snapshot did, for host tensors) and puts it to the step
writer (by pointer, no copy). The cache
space is given back after the writer has written it out: when the snapshot
asks for space, or when the step is finished. At the end of a checkpoint,
the committer (:mod:`commit`) makes the data durable and then records the step
in the index. Any failure marks the checkpoint failed; it is raised to the
training loop at its next ``write()``, ``wait()`` or ``close()``.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from typing import Callable

from .cache import HostCache
from .digest import Digest
from .dtypes import dtype_name, storage_dtype
from .items import TensorRecord
from .snapshot import Begin, End, Message, NeedSpace, PendingCheckpoint, Piece, Pieces, Stop


class _Step:
    """Flush state of one checkpoint."""

    def __init__(self, ckpt: PendingCheckpoint):
        self.ckpt = ckpt
        self.writer = None
        self.digests: dict[int, Digest] = {}
        self.records: list[TensorRecord] = []


class Flusher:
    """The flusher thread. ``committer`` (:class:`commit.Committer`) opens each step's
    writer and commits it, so that this module knows no backend or index. It is asked to
    commit failed checkpoints too (it does not commit them): with several ranks, the
    ranks agree on every step's outcome."""

    def __init__(self, cache: HostCache, committer, refuse_nonfinite: bool = False):
        self.cache = cache
        self.refuse_nonfinite = refuse_nonfinite
        self.committer = committer
        self.inbox: queue.Queue[Message] = queue.Queue()
        self.unwritten: list = []  # regions put to the writer, not yet written out
        self.unwritten_bytes = 0
        self.flush_seconds = 0.0
        self.thread = threading.Thread(target=self._run, name="dh-flush", daemon=True)
        self.thread.start()

    def _run(self) -> None:
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
                self._guard(current, lambda: setattr(current, "writer", self.committer.open_writer(ckpt.step)))
            case Pieces(pieces):
                for piece in pieces:
                    if current.ckpt.error is None:
                        self._guard(current, lambda: self._put(current, piece))
                    if current.ckpt.error is not None:
                        self._release()
                        if piece.region is not None and piece.owner:
                            self.cache.free(piece.region)
            case NeedSpace():
                if current is not None and current.writer is not None and current.ckpt.error is None:
                    self._guard(current, current.writer.write_out)
                self._release()
            case End():
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
            self.cache.free(region)
        self.unwritten.clear()
        self.unwritten_bytes = 0

    def _put(self, step: _Step, piece: Piece) -> None:
        item = step.ckpt.tensors[piece.index]
        t = item.tensor
        sdtype = storage_dtype(t.dtype)
        if piece.index not in step.digests:
            # a host tensor's digest comes with its pieces: the snapshot adds them as it copies
            step.digests[piece.index] = piece.digest or Digest()
            block = {} if item.global_shape is None else {"block": (item.global_shape, item.offset)}
            step.writer.define(item.name, sdtype, tuple(t.shape), dtype_name(t.dtype), **block)
        digest = step.digests[piece.index]
        if piece.region is not None:
            if piece.copied is not None:
                piece.copied.synchronize()
            raw = self.cache.array(piece.region)
            if not piece.owner or piece.at:  # one of several small tensors in the region
                raw = raw[piece.at:piece.at + max(math.prod(piece.count), 1) * sdtype.itemsize]
            array = raw.view(sdtype).reshape(piece.count)
            if piece.digest is None:
                digest.update(array, t.dtype)
            step.writer.put(item.name, array, piece.start)
            if piece.owner:
                self.unwritten.append(piece.region)
                self.unwritten_bytes += piece.region.nbytes
                if self.unwritten_bytes * 4 >= self.cache.capacity and step.writer.write_out_early:
                    step.writer.write_out()  # the snapshot fills the rest of the cache meanwhile
                    self._release()
        if piece.last:
            stats = digest.stats()
            if self.refuse_nonfinite and stats["nonfinite"]:
                raise ValueError(
                    f"tensor {item.name!r} holds {stats['nonfinite']} NaN or infinite value(s); "
                    "refused because refuse_nonfinite=True"
                )
            step.records.append(TensorRecord(
                item.name, dtype_name(t.dtype), tuple(t.shape),
                t.numel() * sdtype.itemsize, digest.checksum(), "raw", stats,
                item.global_shape, item.offset,
            ))

    def _finish(self, step: _Step) -> None:
        ckpt = step.ckpt
        try:
            self.committer.commit(ckpt, step.writer, step.records)  # also on failure: ranks decide together
        except BaseException as exc:
            ckpt.fail(exc)
        finally:
            if ckpt.error is not None and step.writer is not None:
                try:
                    step.writer.abort()
                except BaseException:
                    pass
            self._release()
            ckpt.done.set()
