"""The pipeline of checkpoints after ``write()``: host cache -> snapshot thread ->
flusher thread -> committer, the training hooks that wait for the snapshot, and
the report of checkpoints that failed.

Both threads start at the first checkpoint and take checkpoints one at a time,
in the order submitted, so steps commit in order. Several may be in flight; the
host cache bounds their memory.
"""

from __future__ import annotations

import errno
import sqlite3
import threading
import time
import weakref
from typing import Any, Iterable

import torch
from torch import nn

from .cache import HostCache
from .commit import Committer
from .errors import CheckpointError
from .flush import Flusher
from .layout import integral
from .snapshot import PendingCheckpoint, Snapshotter


class Pipeline:
    """Checkpoints in flight, from the snapshot to the commit."""

    def __init__(self, committer: Committer, cache_bytes: int, piece_bytes: int, refuse_nonfinite: bool,
                 key_every: int, keep_up: bool | None = None):
        self.committer = committer
        self.key_every, self.keep_up = key_every, keep_up
        self.cache_bytes, self.piece_bytes = cache_bytes, piece_bytes
        self.refuse_nonfinite = refuse_nonfinite
        self.cache: HostCache | None = None
        self._snapshotter: Snapshotter | None = None
        self._flusher: Flusher | None = None
        self._pending: list[PendingCheckpoint] = []
        self._last: PendingCheckpoint | None = None
        self._hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module/optimizer -> hook handle
        self._closed = False
        self._inherited = False  # by a child made by fork (inherited())
        self.hook_seconds = 0.0  # training-thread time spent waiting in the hooks
        self.training_waits = threading.Event()  # set while a hook waits: the flusher's keep_up reads it
        self.commit_waits = threading.Event()  # set while write() waits for a commit (wait_in_flight)

    def submit(self, ckpt: PendingCheckpoint, objects: Iterable[Any]) -> None:
        """Queue ``ckpt`` (of ``objects``: the model, the optimizer, the extras) for its
        snapshot, after the previous one's."""
        self._start(ckpt)
        self.install_hooks(objects)
        if any(t.tensor.is_cuda for t in ckpt.tensors):
            ckpt.ready_event = torch.cuda.current_stream().record_event()
        self._last = ckpt
        self._pending.append(ckpt)
        self._snapshotter.submit(ckpt)

    def withdraw(self, ckpt: PendingCheckpoint, why: BaseException) -> bool:
        """After :meth:`submit` of ``ckpt`` raised or was interrupted (Ctrl-C, at any line):
        whether ``ckpt`` was withdrawn (it never reached the snapshot thread: as if never
        submitted); else it goes on and commits."""
        if self._snapshotter is None:  # no thread was started: nothing reached one
            return True
        if not self._snapshotter.withdraw(ckpt, why):
            return False
        self._pending = [c for c in self._pending if c is not ckpt]
        if self._last is ckpt:  # write() waited for the one before it: nothing to wait for
            self._last = None
        return True

    def inherited(self) -> None:
        """In a child made by fork, which has none of the threads: nothing to wait for
        (the training hooks wait no more)."""
        self._last, self._pending, self._inherited = None, [], True

    def submit_failed(self, step: int, exc: BaseException) -> None:
        """Queue a failed placeholder of ``step``: with several ranks, the other ranks'
        flushers wait at the commit for this rank's word on every step."""
        try:  # the step as the other ranks compare it (a numpy integer, say, is not JSON)
            step = integral(step)
        except TypeError:
            step = repr(step)
        ckpt = PendingCheckpoint(step, [], {"items": {}, "objects": {}})
        ckpt.fail(exc)
        self._start(ckpt)
        self._pending.append(ckpt)
        self._snapshotter.submit(ckpt)

    def _start(self, ckpt: PendingCheckpoint) -> None:
        if self._snapshotter is not None:
            return
        pin = torch.cuda.is_available() and any(t.tensor.is_cuda for t in ckpt.tensors)
        self.cache = HostCache(self.cache_bytes, pin=pin)
        self._flusher = Flusher(self.cache, self.committer, self.refuse_nonfinite, self.key_every,
                                self.keep_up, self.training_waits, self.commit_waits)
        self._snapshotter = Snapshotter(self.cache, self._flusher.inbox, self.piece_bytes)

    # --- waiting ------------------------------------------------------------------------

    def wait_snapshot(self, volatile_only: bool = False) -> None:
        """Wait until the last checkpoint's tensors (or only its volatile ones) are copied."""
        ckpt = self._last
        if ckpt is None:
            return
        done = ckpt.volatile_done if volatile_only else ckpt.snapshot_done
        if not done.is_set():
            ckpt.training_waited = True
            self.training_waits.set()
            try:
                done.wait()
            finally:
                self.training_waits.clear()
        event = ckpt.volatile_copied if volatile_only else ckpt.copied
        if event is not None:  # the training stream must not overwrite before the copy ran
            torch.cuda.current_stream().wait_event(event)

    def wait_in_flight(self, at_most: int) -> None:
        """Wait until at most ``at_most`` submitted checkpoints are neither committed nor failed."""
        waited = [c for c in self._pending if not c.done.is_set()][:-at_most or None]
        if not waited:
            return
        self.commit_waits.set()
        try:
            for ckpt in waited:
                ckpt.done.wait()
        finally:
            self.commit_waits.clear()

    def wait(self) -> None:
        """Wait until every submitted checkpoint is committed or failed."""
        for ckpt in list(self._pending):
            ckpt.done.wait()

    def failures(self) -> list[PendingCheckpoint]:
        """The checkpoints that failed since the last call (each reported once)."""
        done = [c for c in self._pending if c.done.is_set()]
        self._pending = [c for c in self._pending if not c.done.is_set()]
        return [c for c in done if c.error is not None]

    def install_hooks(self, objects: Iterable[Any]) -> None:
        """Make training wait for the snapshot only where it must: a forward for the
        volatile tensors (buffers it changes), an optimizer step for the rest. Every
        module and optimizer written is hooked, the extras' too (a GAN's discriminator
        and its optimizer step before the generator's forward). Submodules are not: a
        hook inside a compiled model breaks its graph."""
        for obj in objects:
            if isinstance(obj, nn.Module) and obj not in self._hooks:
                self._hooks[obj] = obj.register_forward_pre_hook(lambda *_: self._hook_wait(volatile_only=True))
            elif isinstance(obj, torch.optim.Optimizer) and obj not in self._hooks:
                self._hooks[obj] = obj.register_step_pre_hook(lambda *_: self._hook_wait())

    def _hook_wait(self, volatile_only: bool = False) -> None:
        if self._inherited:
            return
        t0 = time.perf_counter()
        self.wait_snapshot(volatile_only)
        self.hook_seconds += time.perf_counter() - t0

    @property
    def raw_to_keep_up(self) -> int:
        return 0 if self._flusher is None else self._flusher.raw_to_keep_up

    def removed(self, steps: list[int] | None) -> None:
        """``steps`` were removed from the run (prune, truncate; after :meth:`wait`), or
        None: a removal failed part-way. No later step may be encoded against them."""
        if self._flusher is None:
            return
        if steps is None:  # the flusher is idle: every checkpoint is done
            self._flusher.anchors.forget()
        else:
            self._flusher.anchors.drop(steps)

    def close(self) -> None:
        """Remove the hooks and end the threads (after :meth:`wait`). Interrupted, it may
        be called again: it goes on where it stopped (:attr:`busy` until it is done)."""
        for handle in list(self._hooks.values()):
            handle.remove()
        self._hooks.clear()
        if self._snapshotter is not None:
            self._snapshotter.stop()
            self._flusher.ended.wait()
        try:
            if not self._closed:
                self.committer.close()
        finally:  # also when the ranks disagree at the close: the memory goes all the same
            self._closed = True
            if self._snapshotter is not None and not self.busy:
                # the threads are done: let go of the host cache and the delta anchors (a closed
                # Checkpointer kept cache + two values of every delta-encoded tensor until collected)
                self._flusher.anchors.forget()
                self.cache.release()

    @property
    def busy(self) -> bool:
        """Whether :meth:`close` was interrupted before the threads and the committer were done."""
        threads = (self._snapshotter, self._flusher) if self._snapshotter is not None else ()
        return not self._closed or not all(t.ended.is_set() for t in threads)


def checkpoint_failed(run_dir: str, failed: list[PendingCheckpoint]) -> CheckpointError:
    """The error that reports ``failed`` checkpoints to the training loop, caused by
    the first one's error."""
    first = failed[0]
    hint = ("; no space left on device: free space, then write again (committed steps are intact)"
            if _disk_full(first.error) else "")
    if len(failed) == 1:
        what = f"checkpoint of step {first.step} in {run_dir} failed and was not committed"
    else:  # several were in flight when the first failed: each is reported once, here
        steps = ", ".join(str(c.step) for c in failed)
        what = (f"checkpoints of steps {steps} in {run_dir} failed and were not committed "
                f"(step {first.step}'s error)")
    error = CheckpointError(f"{what}: {type(first.error).__name__}: {first.error}{hint}")
    error.__cause__ = first.error  # as ``raise ... from first.error`` would
    return error


def _disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the device is full."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(exc, sqlite3.OperationalError) and "disk is full" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
