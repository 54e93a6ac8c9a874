"""The lazy snapshot: copy the tensors of a checkpoint into the host cache in the background.

``write()`` only records *what* to capture (a :class:`PendingCheckpoint`). The
snapshot thread copies tensors into the host cache (device-to-host on a side
CUDA stream ordered after the training stream by an event; host-to-host for
CPU tensors, with ``copy_``, which releases the GIL), piece by piece, and
hands each piece to the flusher; an immutable host tensor (one read from a file
for an import) is handed on in its own memory, uncopied. Volatile tensors
(buffers changed by forward) are copied first; the pipeline's hooks wait on
:attr:`volatile_done` before the next forward and on :attr:`snapshot_done`
before the next optimizer step.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch

from .cache import HostCache, Region, aligned
from .digest import Digest
from .dtypes import storage_dtype, storage_torch_dtype
from .items import TensorItem


SMALL_BYTES = 1 << 20  # tensors up to this size are copied and flushed together


@dataclass
class PendingCheckpoint:
    """One ``write()`` on its way through snapshot, flush and commit."""

    step: int
    tensors: list[TensorItem]
    values: dict[str, Any]
    ready_event: Any = None  # CUDA event on the training stream at write() time
    volatile_done: threading.Event = field(default_factory=threading.Event)
    snapshot_done: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    volatile_copied: Any = None  # CUDA event after the volatile copies
    copied: Any = None  # CUDA event after all copies
    error: BaseException | None = None
    issued: float = field(default_factory=time.time)
    plan: Any = None  # retention.StepPlan: in which unit each tensor goes, and how it is encoded
    cache_end: int | None = None  # the cache's ``allocated`` once this snapshot was copied
    # pieces handed on in the tensors' own memory (immutable ones): the snapshot is done, and
    # the next write() may read its tensors, only once the flusher is done with them
    handed_on: bool = False
    waited_for_space: bool = False  # the snapshot waited for the flush to free cache space
    training_waited: bool = False  # training waited for this snapshot (the pipeline's hooks)
    # with several ranks: [name, dtype, shape] of each tensor this rank takes as replicated,
    # compared across the ranks at commit (each writes its part of a plan made from them)
    replicated: list | None = None
    taken: bool = False  # the snapshot thread took it from its inbox
    withdrawn: bool = False  # its write() was interrupted before it reached the inbox

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc


@dataclass
class Withdrawn:
    """The word that ``ckpt``'s write() was interrupted (:meth:`Snapshotter.withdraw`)."""

    ckpt: PendingCheckpoint
    why: BaseException
    applied: threading.Event = field(default_factory=threading.Event)

    def apply(self) -> None:
        ckpt = self.ckpt
        if not ckpt.taken:  # never submitted: nothing downstream knows it (taken, it goes on)
            ckpt.withdrawn = True
            ckpt.fail(self.why)
            for event in (ckpt.volatile_done, ckpt.snapshot_done, ckpt.done):
                event.set()
        self.applied.set()


@dataclass
class Piece:
    """A box of one tensor, copied into ``region`` of the host cache (or, of an immutable
    tensor, ``data``: its bytes in the tensor's own memory)."""

    ckpt: PendingCheckpoint
    index: int  # of the tensor in ckpt.tensors
    region: Region
    start: tuple[int, ...]
    count: tuple[int, ...]
    last: bool
    copied: Any = None  # CUDA event after the copy
    at: int = 0  # byte offset of this piece in the region (small tensors share one)
    owner: bool = True  # the piece whose write gives the region back
    digest: Digest | None = None  # the tensor's running digest, this piece already added
    data: np.ndarray | None = None  # the bytes of an immutable tensor's piece, in its own memory


# What the snapshot thread tells the flusher thread, in order: per checkpoint one
# Begin, Pieces as they are copied (with NeedSpace whenever the cache is full), one
# End; Stop once, when the Checkpointer closes.

@dataclass
class Begin:
    ckpt: PendingCheckpoint


@dataclass
class Pieces:
    """Copied pieces: one of a large tensor, or many small tensors sharing one region."""
    pieces: list[Piece]


@dataclass
class NeedSpace:
    """The cache is full: the flusher should write out what it holds and give it back."""


@dataclass
class End:
    ckpt: PendingCheckpoint


@dataclass
class Stop:
    pass


Message = Begin | Pieces | NeedSpace | End | Stop


def pieces(shape: tuple[int, ...], itemsize: int, max_bytes: int) -> Iterator[tuple[tuple, tuple]]:
    """Split a C-order array into boxes ``(start, count)`` of at most ``max_bytes``,
    each contiguous in memory, in memory order."""
    total = int(np.prod(shape)) * itemsize if shape else itemsize
    if total <= max_bytes or not shape:
        yield (0,) * len(shape), tuple(shape)
        return
    inner = int(np.prod(shape[1:])) * itemsize
    if inner <= max_bytes:
        rows = max(1, max_bytes // max(inner, 1))
        for i in range(0, shape[0], rows):
            n = min(rows, shape[0] - i)
            yield (i,) + (0,) * (len(shape) - 1), (n,) + tuple(shape[1:])
        return
    for i in range(shape[0]):
        for start, count in pieces(tuple(shape[1:]), itemsize, max_bytes):
            yield (i,) + start, (1,) + count


def _storage_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as its storage dtype (bfloat16 as uint16, ...); a scalar as shape (1,)."""
    return (t if t.dim() else t.reshape(1)).view(storage_torch_dtype(t.dtype))


def _box(t: torch.Tensor, start: tuple, count: tuple) -> torch.Tensor:
    """The view of ``t`` for a box from :func:`pieces`."""
    for dim, (s, c) in enumerate(zip(start, count)):
        if c != t.shape[dim]:
            t = t.narrow(dim, s, c)
    return t


class Snapshotter:
    """The snapshot thread: copies pending checkpoints into the cache, in order."""

    def __init__(self, cache: HostCache, out: "queue.Queue[Message]", piece_bytes: int):
        self.cache = cache
        self.out = out
        self.piece_bytes = max(64, min(piece_bytes, cache.capacity // 4))
        # put() in one C call: a KeyboardInterrupt in write() cannot leave a checkpoint half-queued
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.stream = None
        self.closing = False
        self.ended = threading.Event()  # the thread is done (not join(): see Flusher.ended)
        self.thread = threading.Thread(target=self._run, name="dh-snapshot", daemon=True)
        self.thread.start()

    def submit(self, ckpt: PendingCheckpoint) -> None:
        self.inbox.put(ckpt)

    def withdraw(self, ckpt: PendingCheckpoint, why: BaseException) -> bool:
        """After an interruption (Ctrl-C) around :meth:`submit`: whether ``ckpt`` never
        reached the inbox (then it is withdrawn: failed, done, and never written); else it
        goes on. The inbox is in order: if it was put there, the thread takes it first."""
        marker = Withdrawn(ckpt, why)
        if self.ended.is_set():  # no thread to take either
            marker.apply()
        else:
            self.inbox.put(marker)
            marker.applied.wait()
        return ckpt.withdrawn

    def stop(self) -> None:
        """End the thread after the checkpoints submitted; then the flusher's (twice is harmless)."""
        self.inbox.put(None)
        self.ended.wait()

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            self.ended.set()

    def _serve(self) -> None:
        while True:
            ckpt = self.inbox.get()
            if ckpt is None:
                self.out.put(Stop())
                return
            if isinstance(ckpt, Withdrawn):
                ckpt.apply()
                continue
            ckpt.taken = True
            self.out.put(Begin(ckpt))
            try:
                self._copy(ckpt)
            except BaseException as exc:  # reported by the flusher and at the next call
                ckpt.fail(exc)
            finally:
                ckpt.cache_end = self.cache.allocated
                ckpt.volatile_done.set()
                if not ckpt.handed_on:  # else the flusher says when it is done with them
                    ckpt.snapshot_done.set()
                self.out.put(End(ckpt))

    def _need_space(self, ckpt: PendingCheckpoint) -> None:
        """The cache is full: tell the flusher, which writes out what it holds."""
        ckpt.waited_for_space = True
        self.out.put(NeedSpace())

    def _copy(self, ckpt: PendingCheckpoint) -> None:
        device = next((t.tensor.device for t in ckpt.tensors if t.tensor.is_cuda), None)
        cuda = device is not None
        if cuda and (self.stream is None or self.stream.device != device):
            self.stream = torch.cuda.Stream(device=device)  # a side stream: training's stays free
        if cuda and ckpt.ready_event is not None:
            self.stream.wait_event(ckpt.ready_event)
        small: list[tuple[int, torch.Tensor]] = []  # copied together, one region and one message
        small_bytes = 0
        for index, item in enumerate(ckpt.tensors):
            if ckpt.error is not None:
                break
            if not item.volatile and not ckpt.volatile_done.is_set():
                small, small_bytes = self._copy_small(ckpt, small, cuda), 0
                ckpt.volatile_copied = self._mark(cuda)
                ckpt.volatile_done.set()
            t = item.tensor
            nbytes = t.numel() * storage_dtype(t.dtype).itemsize
            if 0 < nbytes <= min(SMALL_BYTES, self.piece_bytes // 4):
                if small_bytes + aligned(nbytes) > self.piece_bytes:
                    small, small_bytes = self._copy_small(ckpt, small, cuda), 0
                small.append((index, t))
                small_bytes += aligned(nbytes)
            elif nbytes and item.immutable and not t.is_cuda and t.is_contiguous():
                self._hand_on_tensor(ckpt, index, t)
            else:
                self._copy_tensor(ckpt, index, t, cuda)
        if ckpt.error is None:
            self._copy_small(ckpt, small, cuda)
        ckpt.volatile_copied = ckpt.volatile_copied or self._mark(cuda)
        ckpt.copied = self._mark(cuda)

    def _mark(self, cuda: bool):
        if not cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def _copy_small(self, ckpt: PendingCheckpoint, small: list, cuda: bool) -> list:
        """Copy many small tensors into one region, handed on as one message: their
        fixed costs (allocation, queue, thread switches) are paid once. Returns []."""
        if not small:
            return []
        sizes = [t.numel() * storage_dtype(t.dtype).itemsize for _, t in small]
        offsets = [0]
        for n in sizes[:-1]:
            offsets.append(offsets[-1] + aligned(n))
        region = self.cache.alloc(
            offsets[-1] + sizes[-1], on_wait=lambda: self._need_space(ckpt),
            cancelled=lambda: ckpt.error is not None,
        )
        buf = self.cache.view(region) if cuda else None  # the destination of device copies
        host = self.cache.array(region)
        batch = []
        for (index, t), at, n in zip(small, offsets, sizes):
            src = _storage_view(t)
            digest = None
            if src.is_cuda:
                with torch.cuda.stream(self.stream):
                    buf[at:at + n].view(src.dtype).view(src.shape).copy_(src, non_blocking=True)
            else:  # numpy views: a tenth of the cost of torch's, for hundreds of small tensors
                src = src.numpy()
                digest = Digest()
                digest.copy_update(host[at:at + n].view(src.dtype).reshape(src.shape), src, t.dtype)
            batch.append(Piece(ckpt, index, region, (0,) * t.dim(), tuple(t.shape), True, at=at,
                               owner=False, digest=digest))
        batch[-1].owner = True
        event = self._mark(cuda)
        for piece in batch:
            piece.copied = event
        self.out.put(Pieces(batch))
        return []

    def _hand_on_tensor(self, ckpt: PendingCheckpoint, index: int, t: torch.Tensor) -> None:
        """An immutable host tensor's pieces, handed on in its own memory: no region of
        the cache, no copy (half the time of a copy and digest in one pass); the digest
        read alone. The cache no longer bounds what is in flight, so the snapshot counts
        as done once the step is committed: the next ``write()`` waits for that, and an
        import holds at most the source being written and the next one."""
        ckpt.handed_on = True
        src = _storage_view(t)
        boxes = list(pieces(tuple(t.shape), storage_dtype(t.dtype).itemsize, self.piece_bytes))
        digest = Digest()
        for k, (start, count) in enumerate(boxes):
            if ckpt.error is not None:
                return
            box = (_box(src, start, count) if count else src).numpy()
            data = box.reshape(-1).view(np.uint8)
            digest.update(box, t.dtype)
            self.out.put(Pieces([Piece(ckpt, index, None, start, count, k == len(boxes) - 1,
                                       digest=digest, data=data)]))

    def _copy_tensor(self, ckpt: PendingCheckpoint, index: int, t: torch.Tensor, cuda: bool) -> None:
        src = _storage_view(t)
        itemsize = storage_dtype(t.dtype).itemsize
        boxes = list(pieces(tuple(t.shape), itemsize, self.piece_bytes)) if t.numel() else []
        digest = None if t.is_cuda else Digest()
        for k, (start, count) in enumerate(boxes):
            nbytes = int(np.prod(count)) * itemsize if count else itemsize
            region = self.cache.alloc(
                nbytes, on_wait=lambda: self._need_space(ckpt),
                cancelled=lambda: ckpt.error is not None,
            )
            box = _box(src, start, count) if count else src
            event = None
            if box.is_cuda:
                with torch.cuda.stream(self.stream):
                    self.cache.view(region).view(src.dtype).view(box.shape).copy_(box, non_blocking=True)
                    event = self._mark(True)
            else:  # numpy: no OpenMP team competing with the training thread's
                box = box.numpy()
                digest.copy_update(self.cache.array(region).view(box.dtype).reshape(box.shape), box, t.dtype)
            self.out.put(Pieces([Piece(ckpt, index, region, start, count, k == len(boxes) - 1, event,
                                       digest=digest)]))
        if not boxes:
            self.out.put(Pieces([Piece(ckpt, index, None, (), tuple(t.shape), True)]))
