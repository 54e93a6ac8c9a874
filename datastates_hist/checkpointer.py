"""The Checkpointer: ``write()`` every iteration, ``restore()`` after a restart.

A front door over three stages: :mod:`collect` asks the State Providers for
the items of a ``write()`` (no bytes copied), :mod:`pipeline` carries them
through snapshot -> flush -> commit in the background, and :mod:`layout` /
:mod:`index` are the run they end in.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import threading
import time
import warnings
from typing import Any

from . import lifetime
from .backends import get_backend, make_backend
from .cache import ALIGN
from .collect import Collector, step_number
from .commit import Committer, remove_uncommitted
from .errors import CheckpointError, CorruptionError, StepNotFoundError, StepOrderError, StoreLockedError
from .group import as_group
from .index import Index
from .layout import (MAX_STEP, WRITER_LOCK, count_of, finished_units, index_path, integral, run_path, steps_dir,
                     take_writer_lock)
from .pipeline import Pipeline, checkpoint_failed
from .restore import Restored, restore_step
from .retention import Retention, check_codec, check_policy, check_trajectory, key_every_count, policy_key

DEFAULT_CACHE_BYTES = 1 << 30
DEFAULT_PIECE_BYTES = 64 << 20
DEFAULT_KEY_EVERY = 16
# a crash loses at most this many written steps, and close() drains at most as many: a
# small state every step would otherwise fill the cache with thousands of steps that
# commit long after write() returned
DEFAULT_STEPS_IN_FLIGHT = 8


def _byte_count(value: Any, what: str) -> int:
    try:
        return integral(value)
    except TypeError:
        raise TypeError(f"{what} must be a whole number of bytes, got {value!r}") from None


class Checkpointer:
    """Checkpoints training state into a versioned history at ``path``.

    Args:
        path: the run directory (created if missing).
        backend: ``"adios2"`` (default) or ``"hdf5"``, or a registered name.
        model, optimizer: objects bound once, used when ``write``/``restore``
            are called without them.
        host_cache_bytes: the bound on host memory used by snapshots.
        piece_bytes: tensors larger than this are streamed through the cache in pieces.
        refuse_nonfinite: fail (not commit) a step holding a NaN or infinite
            value; by default such values are stored and counted in the statistics.
        comm: write one history from every rank of a job (the constructor,
            ``write``, ``truncate``, ``prune`` and ``close`` are then collective):
            an mpi4py communicator (ADIOS2 then writes each step as one BP5 file,
            collectively), or ``"torch"`` / a ``torch.distributed`` process group
            (each rank writes its own file of each step). See :mod:`sharding`
            for which rank writes what.
        backend_options: options of the backend, such as ADIOS2 engine
            ``parameters={"NumAggregators": "2"}``.
        keep: which restore points stay, as a policy (``dh.KeepLast(2) |
            dh.KeepEvery(1000)``), applied after every commit; None (default):
            every step stays a restore point.
        trajectory: what a restore point that ``keep`` lets go keeps instead
            (``dh.Trajectory("model/*", every=1)``): it stays as a trajectory
            point, readable but not restorable. Without it, such steps go away.
        codec: how tensors are stored: ``"delta"`` (default: compressed, as the
            residual against earlier values that stay, see :mod:`deltas`),
            ``"key"`` (each compressed alone) or ``"raw"``. Steps written by
            several ranks are stored raw.
        key_every: a delta chain is cut by a key every this many steps, so a read
            decodes at most this many stored values of each tensor it reads (Adam's
            moments are predicted from the weights and each other: three tensors).
        keep_up: what the flush does when it falls behind training: None (default)
            stores tensors raw while the host cache is 90% full and holds a later step's
            snapshot, or training waits for a snapshot (a step larger than the cache):
            the point where the next snapshot, and training, would wait (a tensor begun
            before stores its remaining chunks uncompressed); and once training has
            waited for a snapshot that waited for cache space, whole steps until a
            snapshot fits the cache without waiting;
            True stores raw from half full, or while ``write()`` waits for a commit
            (``max_steps_in_flight``), and runs the flush at nice 19, so it uses
            only the CPU time training leaves (shorter steps, a larger history); False
            always encodes as ``codec`` says, so the history is as small as it can be
            whatever training waits. :attr:`raw_to_keep_up` counts the tensors stored raw.
        max_steps_in_flight: how many written steps may be not yet committed: ``write()``
            waits for the oldest one's commit beyond that (default 8). The host cache
            bounds their bytes; this bounds how far the run's newest committed step
            lags behind training, and so what a crash loses.
    """

    def __init__(self, path: str | os.PathLike, *, backend: str | None = None,
                 model: Any = None, optimizer: Any = None,
                 host_cache_bytes: int = DEFAULT_CACHE_BYTES, piece_bytes: int = DEFAULT_PIECE_BYTES,
                 refuse_nonfinite: bool = False, comm: Any = None, backend_options: dict | None = None,
                 keep: Any = None, trajectory: Any = None, codec: str = "delta",
                 key_every: int = DEFAULT_KEY_EVERY, keep_up: bool | None = None,
                 max_steps_in_flight: int = DEFAULT_STEPS_IN_FLIGHT):
        self.path = run_path(path)
        host_cache_bytes = _byte_count(host_cache_bytes, "host_cache_bytes")
        if host_cache_bytes < ALIGN:  # before the run is opened: nothing to undo
            raise ValueError(f"host cache of {host_cache_bytes} bytes is too small: host_cache_bytes must be at "
                             f"least {ALIGN}")
        piece_bytes = _byte_count(piece_bytes, "piece_bytes")
        if piece_bytes < 1:
            raise ValueError(f"piece_bytes must be at least 1, got {piece_bytes}")
        self.retention = Retention(check_policy(keep), check_trajectory(trajectory))
        self.codec = check_codec(codec)
        if keep_up is not None and not isinstance(keep_up, bool):
            raise TypeError(f"keep_up must be None, True or False, got {keep_up!r}")
        self.key_every = key_every_count(key_every)
        self.max_steps_in_flight = count_of(max_steps_in_flight, "max_steps_in_flight")
        self.group = as_group(comm)
        if self.retention.trajectory is not None and self.group.size > 1:
            raise ValueError("trajectory= is for runs written by one process; with several ranks, "
                             "keep= alone removes the restore points it lets go")
        self._lock_fd = None
        self._pid = os.getpid()  # a process forked from this one must not use it
        self.index = None
        # rank 0 opens the run; every rank learns whether that worked
        failure = None
        if self.group.root:
            try:
                self._open_run(backend)
            except BaseException as exc:
                failure = exc
        verdict = self.group.bcast(None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        if verdict is not None:
            raise CheckpointError(f"rank 0 could not open {self.path} for writing: {verdict}")
        failure = None
        try:
            if not self.group.root:
                self.index = Index(self.path)
            self.backend_name = self.index.backend(backend)
            self.backend = make_backend(self.backend_name, backend_options)
        except BaseException as exc:
            failure = exc
        try:
            # every rank learns whether every other one opened (the others would wait for it
            # in write()), with the same backend and keep= (the ranks write each step together)
            mine = ([f"{type(failure).__name__}: {failure}", None, None] if failure else
                    [None, self.backend_name, policy_key(self.retention.keep)])
            verdict = _ranks_disagree(self.group.allgather(mine))
        except BaseException:
            self._give_back()
            raise
        if failure is not None or verdict is not None:
            self._give_back()
            if failure is not None:
                raise failure
            raise CheckpointError(f"not every rank could open {self.path} for writing: {verdict}")
        self.model, self.optimizer = model, optimizer
        self.host_cache_bytes, self.piece_bytes = host_cache_bytes, piece_bytes
        self.refuse_nonfinite = refuse_nonfinite
        self._collector = Collector(self.group)
        self._committer = Committer(self.path, self.backend, self.backend_name, self.group,
                                    self._collector.rng_prefix, self.retention)
        self._pipeline = Pipeline(self._committer, host_cache_bytes, piece_bytes, refuse_nonfinite, self.key_every,
                                  keep_up)
        self._trajectory_checked: tuple[str, ...] = ()
        self._last_step = self.index.latest()
        self._write_seconds = 0.0
        self.writes = 0
        self.closed = False
        self._finished: threading.Event | None = None  # set once the steps in flight at an interrupted close() are
        self._background_error: BaseException | None = None  # what failed while they were finished
        self._closing = threading.RLock()  # one close() at a time: the lock's descriptor is closed once
        lifetime.hold(self)

    def _open_run(self, backend: str | None) -> None:
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise NotADirectoryError(f"{self.path} is a file, not a run directory")
        try:
            os.makedirs(steps_dir(self.path), exist_ok=True)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            raise PermissionError(f"cannot create the run directory {self.path}: {exc.strerror}") from exc
        if not os.access(self.path, os.W_OK):
            raise PermissionError(f"the run directory {self.path} is not writable: {_why_not_writable(self.path)}")
        lock_path = os.path.join(self.path, WRITER_LOCK)
        new_lock = not os.path.lexists(lock_path)
        try:
            self._lock_fd = take_writer_lock(self.path)
        except StoreLockedError:
            if lifetime.finishing(self.path):
                raise StoreLockedError(
                    f"{self.path} is being written by a Checkpointer of this process whose close() was interrupted: "
                    "it still writes the steps it had in flight (call its close() again to wait for them)") from None
            raise
        try:
            _check_index_exists(self.path)
            self.index = Index(self.path, create=True, backend=backend or "adios2")
            get_backend(self.index.backend(backend))
            remove_uncommitted(steps_dir(self.path), self.index)
        except BaseException:
            if new_lock:  # a refused open leaves the folder as it found it (removed while still held)
                with contextlib.suppress(OSError):
                    os.unlink(lock_path)
            self._give_back()
            raise

    def _give_back(self, report_pending: bool = False) -> None:
        """Close the index and give the lock back (a failed open must not block the next one).
        ``report_pending``: an error is still to be reported by close() or at exit."""
        if self.index is not None:
            self.index.close()
        if self._lock_fd is not None:  # forgotten first: an interrupt after it cannot close it twice
            fd, self._lock_fd = self._lock_fd, None
            os.close(fd)
        if not report_pending:
            lifetime.release(self)

    def inherited(self) -> None:
        """In a child made by fork: close the child's copy of the writer lock (the
        parent's close() must give the run back while the child lives); nothing to wait
        for there (the threads that would end the waits are the parent's)."""
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            os.close(fd)
        self._pipeline.inherited()

    # --- writing ------------------------------------------------------------------------

    def write(self, step: int, model: Any = None, optimizer: Any = None, **extra: Any) -> None:
        """Checkpoint ``step``; returns before any tensor bytes are copied.

        Extra keyword values may be objects with ``state_dict()``, tensors, numpy
        arrays, or plain JSON-like values. RNG states are captured too.

        A failure of an earlier step is raised here. With several ranks, this
        step is issued first (the ranks stay in step), then the failure raised.
        """
        t0 = time.perf_counter()
        self._check_open()
        if self.group.size == 1:
            self._raise_failures()
            self._issue(step, model, optimizer, extra)
        else:
            issued = self.writes
            try:
                self._issue(step, model, optimizer, extra)
            except BaseException as exc:  # the other ranks' flushers wait for this rank's word on the step
                if self.writes == issued:
                    self._pipeline.submit_failed(step, exc)
                raise
            finally:
                self._write_seconds += time.perf_counter() - t0
            self._raise_failures()
            return
        self._write_seconds += time.perf_counter() - t0

    @property
    def cache(self):
        """The host cache (None before the first write)."""
        return self._pipeline.cache

    @property
    def raw_to_keep_up(self) -> int:
        """How many tensors were stored raw, not encoded, because the flush had fallen
        behind training (``keep_up``)."""
        return self._pipeline.raw_to_keep_up

    @property
    def blocked_seconds(self) -> float:
        """Training-thread time spent in ``write()`` and in the hooks' waits."""
        return self._write_seconds + self._pipeline.hook_seconds

    def _issue(self, step: int, model: Any, optimizer: Any, extra: dict) -> None:
        model = model if model is not None else self.model
        optimizer = optimizer if optimizer is not None else self.optimizer
        if model is None:
            raise TypeError("write() needs a model (or bind one: Checkpointer(path, model=...))")
        step = step_number(step)
        if self._last_step is not None and step <= self._last_step:
            raise StepOrderError(
                f"step {step} is not after step {self._last_step}, the newest in {self.path}; "
                f"steps only grow (to branch from an earlier step, call truncate(after=...) first)"
            )
        ckpt = self._collector.collect(step, model, optimizer, extra)
        if self.group.size == 1:
            self._check_trajectory(ckpt)
            ckpt.plan = self.retention.step_plan(step, self.codec)
        if not (ckpt.tensors and ckpt.tensors[0].volatile):  # volatile ones come first
            ckpt.volatile_done.set()  # nothing for the next forward to wait for
        self._pipeline.wait_snapshot()  # the previous one's
        self._pipeline.wait_in_flight(self.max_steps_in_flight - 1)
        before = self._last_step, self.writes
        try:
            self._last_step, self.writes = step, self.writes + 1
            self._pipeline.submit(ckpt, [model, optimizer, *extra.values()])
        except BaseException as exc:  # a Ctrl-C may land after it reached the snapshot thread: it goes on
            if self._pipeline.withdraw(ckpt, exc):
                self._last_step, self.writes = before
            raise

    def _check_trajectory(self, ckpt) -> None:
        """A trajectory must name some tensor (checked when the names change)."""
        names = tuple(t.name for t in ckpt.tensors)
        if self.retention.trajectory is not None and names != self._trajectory_checked:
            self.retention.trajectory.check_matches(list(names), ckpt.step)
            self._trajectory_checked = names

    # --- waiting ------------------------------------------------------------------------

    def wait_snapshot(self) -> None:
        """Wait until the last write's tensors are copied; call it before editing
        parameters in place outside the optimizer."""
        self._check_process()
        self._pipeline.wait_snapshot()

    def wait(self) -> None:
        """Block until every issued write is committed; raise the first failure."""
        self._check_process()
        self._pipeline.wait()
        self._raise_failures()

    def _raise_failures(self) -> None:
        failed = self._pipeline.failures()
        if failed:
            if self._last_step in [c.step for c in failed]:
                self._last_step = self.index.latest()
            raise checkpoint_failed(self.path, failed)

    def _check_process(self) -> None:
        if self._pid != os.getpid():
            raise RuntimeError(f"the Checkpointer of {self.path} belongs to process {self._pid}, which this "
                               "one was forked from: a forked process cannot use it (open a History to read)")

    def _check_open(self) -> None:
        self._check_process()
        if self.closed:
            raise RuntimeError(f"the Checkpointer of {self.path} is closed")

    def close(self) -> None:
        """Wait for every write to commit, then release threads, hooks and the lock.

        Interrupted (a second Ctrl-C while it waits), the steps in flight are finished
        in the background and the run stays locked until they are: no other writer may
        start on it meanwhile. close() again, or the program's end, waits for them. In a process forked from
        the one that opened it, close() does nothing (the parent's threads write)."""
        if self._pid != os.getpid():
            return
        with self._closing:  # reentrant: a signal handler may call close() inside close()
            self._close()

    def _close(self) -> None:
        if self._finished is not None:  # an interrupted close() finishes in the background
            self._finished.wait()
            error, self._background_error = self._background_error, None
            lifetime.release(self)
            if error is not None:
                raise error
            return
        if self.closed:  # a close() interrupted while it gave the run back gives it back now
            self._give_back()
            return
        error = None
        try:
            self.wait()
        except BaseException as exc:
            error = exc
        self.closed = True
        try:
            self._pipeline.close()  # with several ranks, raises if they did not all write the same steps
        except BaseException as exc:
            if error is None:  # else the failed steps' error says more
                error = exc
        finally:
            if self._pipeline.busy:
                self._finish_in_background()
            else:
                self._give_back()
        failed = [] if self._pipeline.busy else self._pipeline.failures()  # after a wait() cut short
        if failed:
            found = checkpoint_failed(self.path, failed)
            if error is None:
                raise found
            error.add_note(f"datastates-hist: {found}")
        if error is not None:
            raise error

    def _finish_in_background(self) -> None:
        """The rest of an interrupted close(), on a thread; what fails there is raised by
        close() called again, or printed by the exit handler, which waits for it too."""
        def finish() -> None:
            try:
                self._pipeline.close()
                failed = self._pipeline.failures()
                if failed:
                    raise checkpoint_failed(self.path, failed)
            except BaseException as exc:
                self._background_error = exc
            finally:
                self._give_back(report_pending=self._background_error is not None)
                self._finished.set()

        self._finished = threading.Event()
        threading.Thread(target=finish, name="dh-close", daemon=True).start()
        warnings.warn(f"datastates-hist: close() of {self.path} was interrupted while steps were being written: "
                      "they are finished in the background, and the run stays locked until they are "
                      "(close() again, or the program's end, waits for them)", RuntimeWarning, stacklevel=3)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the history --------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        self._check_open()  # a closed Checkpointer's index is closed: dh.open(path).steps reads it
        return self.index.steps()

    def truncate(self, after: int) -> list[int]:
        """Drop committed steps after ``after`` (to branch the history from there)."""
        from .retention import remove_steps

        self._check_open()
        try:
            after = integral(after)
        except TypeError:
            raise TypeError(f"truncate(after=...) needs a step number (int), got {after!r}") from None
        return self._after_waiting({"do": "truncate", "after": after}, lambda: self._removing(
            lambda: remove_steps(self.path, self.index, [s for s in self.index.steps() if s > after])))

    def prune(self, keep_last: int | None = None, keep_every: int | None = None,
              dry_run: bool = False) -> list[int]:
        """Delete committed steps that no rule keeps (see :mod:`retention`); returns them."""
        from .retention import policies, prune_index

        self._check_open()
        rules = policies(keep_last, keep_every)
        action = {"do": "prune", "keep_last": None if keep_last is None else rules[0].n,
                  "keep_every": None if keep_every is None else rules[-1].k, "dry_run": bool(dry_run)}
        if dry_run:
            return self._after_waiting(action, lambda: self._on_root(
                lambda: prune_index(self.path, self.index, rules, True)))
        return self._after_waiting(action, lambda: self._removing(lambda: prune_index(self.path, self.index, rules)))

    def _after_waiting(self, action: dict, change):
        """``change()`` once every write is committed. A failure of an earlier step is raised
        first; with several ranks, after the change (as ``write()`` does): a rank may have
        reported it already, and every rank must take part in the change, which they
        first agree on (``action``: what it is, see :func:`commit.disagreement`)."""
        if self.group.size == 1:
            self.wait()
            return change()
        failure = None
        try:
            self.wait()
        except CheckpointError as exc:
            failure = exc
        problem = self._committer.agree(action)  # the flusher is idle: no collective of its own now
        if problem is not None:
            raise CheckpointError(f"{action['do']}() changed nothing in {self.path}: {problem}") from failure
        result = change()
        if failure is not None:
            raise failure
        return result

    def _removing(self, change) -> list[int]:
        """Run ``change`` (removing steps, on rank 0); no later step is encoded against what
        it removed, even when it failed part-way (then nothing is built on what was there)."""
        removed = None
        try:
            removed = self._on_root(change)
            return removed
        finally:
            self._pipeline.removed(removed)
            self._last_step = self.index.latest()

    def _on_root(self, change):
        """Run ``change`` (of the run's files and index) on rank 0; its result on every rank."""
        outcome = {"error": None, "result": None}
        if self.group.root:
            try:
                outcome["result"] = change()
            except Exception as exc:
                if self.group.size == 1:
                    raise
                outcome["error"] = f"{type(exc).__name__}: {exc}"
        outcome = self.group.bcast(outcome)
        if outcome["error"] is not None:
            raise CheckpointError(f"rank 0 failed to change {self.path}: {outcome['error']}")
        return outcome["result"]

    def restore(self, step: int | None = None, model: Any = None, optimizer: Any = None, *,
                strict: bool = True, rng: bool = True, **extra: Any) -> Restored:
        """Load a committed step (default: the newest) into the given objects, in place.

        Strict by default: missing, unexpected or mismatched items raise one
        :class:`RestoreMismatchError` before anything is loaded. Every tensor's
        checksum is verified. RNG states are restored unless ``rng=False``.
        """
        self._check_open()
        if step is not None:
            try:
                step = integral(step)
            except TypeError:
                raise TypeError(f"restore() needs a step number (int) or None for the newest, got {step!r}") from None
            if step > MAX_STEP:  # beyond what the index can even be asked for
                raise StepNotFoundError(f"step {step} is not committed in {self.path}: steps go up to "
                                        f"2**63-1 = {MAX_STEP}")
        self.wait()
        model = model if model is not None else self.model
        optimizer = optimizer if optimizer is not None else self.optimizer
        return restore_step(self.path, step, model, optimizer, strict=strict, rng=rng, extra=extra,
                            rank=self.group.rank, world_size=self.group.size)


def _ranks_disagree(opened: list[list]) -> str | None:
    """Why the ranks cannot write together: ``opened`` holds each rank's ``[error,
    backend, keep]`` after opening; None when every rank opened with rank 0's backend
    and policies."""
    for rank, (error, backend, keep) in enumerate(opened):
        if error:
            return f"rank {rank}: {error}"
        if backend != opened[0][1]:
            return (f"rank {rank} writes with the backend {backend!r} and rank 0 with {opened[0][1]!r}: "
                    "pass the same backend= on every rank")
        if keep != opened[0][2]:
            return f"rank {rank} has keep={keep} and rank 0 keep={opened[0][2]}: pass the same keep= on every rank"
    return None


def _check_index_exists(run_dir: str) -> None:
    """Refuse to start a new index beside finished step data: the old index was
    lost, and the new one would make the writer delete every step as uncommitted."""
    if os.path.exists(index_path(run_dir)):
        return
    finished = finished_units(run_dir)
    if finished:
        raise CorruptionError(
            f"{run_dir} holds {len({unit.partition('.')[0] for unit in finished})} step(s) of data but no index "
            f"({index_path(run_dir)} is "
            f"missing); nothing was changed. Rebuild the index with: datastates-hist repair {run_dir}"
        )


def _why_not_writable(path: str) -> str:
    return "read-only file system" if os.statvfs(path).f_flag & os.ST_RDONLY else "permission denied"
