"""The Checkpointer: ``write()`` every iteration, ``restore()`` after a restart.

The path of a checkpoint: :meth:`Checkpointer.write` asks the State Providers
for items (no bytes copied) -> :mod:`snapshot` copies them into the host cache
in the background -> :mod:`flush` puts them to the backend -> :mod:`commit`
makes them durable and records the step in the index.
"""

from __future__ import annotations

import atexit
import errno
import operator
import os
import sqlite3
import sys
import threading
import time
import weakref
from typing import Any

import torch
from torch import nn

from . import values as values_codec
from .backends import get_backend, make_backend
from .cache import HostCache
from .commit import commit_collective, commit_step, remove_uncommitted
from .dtypes import STORABLE, storage_dtype
from .errors import (
    CheckpointError, CorruptionError, StepNotFoundError, StepOrderError,
)
from .flush import Flusher
from .group import as_group
from .index import Index, index_path
from .items import TensorItem, ValueItem, under
from .providers import Context, provider_for
from .restore import Restored, restore_step
from .sharding import dtensor_item, is_dtensor, split_replicated
from .snapshot import PendingCheckpoint, Snapshotter
from .layout import MAX_STEP, finished_units, steps_dir, take_writer_lock
from .torch_providers import RNG, parameter_names

DEFAULT_CACHE_BYTES = 1 << 30
DEFAULT_PIECE_BYTES = 64 << 20


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
    """

    def __init__(self, path: str | os.PathLike, *, backend: str | None = None,
                 model: Any = None, optimizer: Any = None,
                 host_cache_bytes: int = DEFAULT_CACHE_BYTES, piece_bytes: int = DEFAULT_PIECE_BYTES,
                 refuse_nonfinite: bool = False, comm: Any = None, backend_options: dict | None = None):
        self.path = os.fspath(path)
        self.group = as_group(comm)
        self._lock_fd = None
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
        try:
            if not self.group.root:
                self.index = Index(self.path)
            self.backend_name = self.index.backend(backend)
            self.backend = make_backend(self.backend_name, backend_options)
        except BaseException:
            self._give_back()
            raise
        self.refuse_nonfinite = refuse_nonfinite
        self.model, self.optimizer = model, optimizer
        self.host_cache_bytes, self.piece_bytes = host_cache_bytes, piece_bytes
        self.cache: HostCache | None = None
        self._snapshotter: Snapshotter | None = None
        self._flusher: Flusher | None = None
        self._flush_index: Index | None = None
        self._pending: list[PendingCheckpoint] = []
        self._last: PendingCheckpoint | None = None
        self._last_step = self.index.latest()
        self._checked_names: tuple[str, ...] = ()
        self._hooks: dict[int, Any] = {}
        self.blocked_seconds = 0.0  # training-thread time spent in write() and in the hooks
        self.writes = 0
        self.closed = False
        _OPEN.add(self)
        _close_first_at_exit()  # the backend's library may have registered its exit handler just now

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
        self._lock_fd = take_writer_lock(self.path)
        try:
            _check_index_exists(self.path)
            self.index = Index(self.path, create=True, backend=backend or "adios2")
            get_backend(self.index.backend(backend))
            remove_uncommitted(steps_dir(self.path), self.index)
        except BaseException:
            self._give_back()
            raise

    def _give_back(self) -> None:
        """Close the index and give the lock back (a failed open must not block the next one)."""
        if self.index is not None:
            self.index.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)

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
            try:
                self._issue(step, model, optimizer, extra)
            except BaseException as exc:  # the other ranks' flushers wait for this rank's word on the step
                self._submit_failed(step, exc)
                raise
            finally:
                self.blocked_seconds += time.perf_counter() - t0
            self._raise_failures()
            return
        self.blocked_seconds += time.perf_counter() - t0

    def _issue(self, step: int, model: Any, optimizer: Any, extra: dict) -> None:
        model = model if model is not None else self.model
        optimizer = optimizer if optimizer is not None else self.optimizer
        if model is None:
            raise TypeError("write() needs a model (or bind one: Checkpointer(path, model=...))")
        step = _step_number(step)
        if self._last_step is not None and step <= self._last_step:
            raise StepOrderError(
                f"step {step} is not after step {self._last_step}, the newest in {self.path}; "
                f"steps only grow (to branch from an earlier step, call truncate(after=...) first)"
            )
        ckpt = self._collect(step, model, optimizer, extra)
        if not (ckpt.tensors and ckpt.tensors[0].volatile):  # volatile ones come first
            ckpt.volatile_done.set()  # nothing for the next forward to wait for
        self._wait_snapshot()
        self._start_threads(ckpt)
        self._install_hooks(model, optimizer)
        if any(t.tensor.is_cuda for t in ckpt.tensors):
            ckpt.ready_event = torch.cuda.current_stream().record_event()
        self._last_step = step
        self._last = ckpt
        self._pending.append(ckpt)
        self._snapshotter.submit(ckpt)
        self.writes += 1

    def _submit_failed(self, step: int, exc: BaseException) -> None:
        ckpt = PendingCheckpoint(step, [], {"items": {}, "objects": {}})
        ckpt.fail(exc)
        self._start_threads(ckpt)
        self._pending.append(ckpt)
        self._snapshotter.submit(ckpt)

    def _collect(self, step: int, model: Any, optimizer: Any, extra: dict) -> PendingCheckpoint:
        """Items of every object, checked before anything is queued."""
        ctx = Context(param_names=parameter_names(model) if isinstance(model, nn.Module) else {})
        objects = {"model": model, self._rng_prefix: RNG()}
        if optimizer is not None:
            objects["optim"] = optimizer
        for key, value in extra.items():
            _check_name(f"extra/{key}", "extra")
            objects[f"extra/{key}"] = value
        tensors: list[TensorItem] = []
        items_values: dict[str, Any] = {}
        kinds: dict[str, str] = {}
        for prefix, obj in objects.items():
            provider = provider_for(obj)
            kinds[prefix] = type(provider).__name__
            try:
                for item in provider.items(obj, ctx):
                    name = f"{prefix}/{item.name}" if item.name else prefix
                    if isinstance(item, ValueItem):
                        if name in items_values:
                            raise ValueError(f"two values are named {name!r}; rename one")
                        items_values[name] = item.value
                    else:
                        item.name = name
                        if is_dtensor(item.tensor):
                            item = self._dtensor_block(item)
                            if item is None:
                                continue
                        _check_tensor(name, item.tensor)
                        _check_shard(name, item)
                        tensors.append(item)
            except values_codec.UnsupportedValueError as exc:
                raise TypeError(f"cannot checkpoint {prefix!r}: {exc}") from None
            except values_codec.NestingError as exc:
                raise ValueError(f"cannot checkpoint {prefix!r}: {exc}") from None
        self._check_names(tensors)
        if self.group.size > 1:
            tensors = self._my_part(tensors)
        tensors.sort(key=lambda t: not t.volatile)  # volatile first; stable otherwise
        return PendingCheckpoint(step, tensors, {"items": items_values, "objects": kinds})

    def _check_names(self, tensors: list[TensorItem]) -> None:
        """Names the backends can store; checked once per set of names (the same every step)."""
        names = tuple(t.name for t in tensors)
        if names != self._checked_names:
            check_tensor_names(names)
            self._checked_names = names

    @property
    def _rng_prefix(self) -> str:
        """RNG states differ between ranks: each rank keeps its own."""
        return "rng" if self.group.size == 1 else f"rng/rank{self.group.rank}"

    def _dtensor_block(self, item: TensorItem) -> TensorItem | None:
        mesh_size = item.tensor.device_mesh.size()
        if mesh_size > self.group.size:
            raise ValueError(
                f"tensor {item.name!r} is a DTensor over {mesh_size} ranks, but this Checkpointer has "
                f"{self.group.size}: create it with comm=... on every rank"
            )
        return dtensor_item(item)

    def _my_part(self, tensors: list[TensorItem]) -> list[TensorItem]:
        """Blocks of shards stay; tensors every rank holds are split among the ranks;
        this rank's own (RNG) tensors stay whole."""
        own = [t for t in tensors if under(t.name, self._rng_prefix)]
        rest = [t for t in tensors if not under(t.name, self._rng_prefix)]
        shards = [t for t in rest if t.global_shape is not None]
        replicated = [t for t in rest if t.global_shape is None]
        return own + shards + split_replicated(replicated, self.group.rank, self.group.size)

    def _start_threads(self, ckpt: PendingCheckpoint) -> None:
        if self._snapshotter is not None:
            return
        pin = torch.cuda.is_available() and any(t.tensor.is_cuda for t in ckpt.tensors)
        self.cache = HostCache(self.host_cache_bytes, pin=pin)
        self._flusher = Flusher(self.cache, self._open_writer, self._commit, self.refuse_nonfinite)
        self._snapshotter = Snapshotter(self.cache, self._flusher.inbox, self.piece_bytes)

    def _open_writer(self, step: int):
        if self.group.size == 1:
            return self.backend.begin_step(steps_dir(self.path), step)
        return self.backend.begin_step(steps_dir(self.path), step, group=self.group)

    def _commit(self, ckpt: PendingCheckpoint, writer, records) -> None:
        if self._flush_index is None and self.group.root:  # SQLite connections belong to one thread
            self._flush_index = Index(self.path, create=True)
        if self.group.size == 1:
            if ckpt.error is None:
                commit_step(self._flush_index, self.backend_name, ckpt.step, writer, records, ckpt.values)
            return
        own = {key: {k: v for k, v in ckpt.values.get(key, {}).items() if under(k, self._rng_prefix)}
               for key in ("items", "objects")}
        commit_collective(self.group, self._flush_index, self.backend_name, ckpt, writer, records, own)

    # --- waiting ------------------------------------------------------------------------

    def wait_snapshot(self) -> None:
        """Wait until the last write's tensors are copied; call it before editing
        parameters in place outside the optimizer."""
        self._wait_snapshot()

    def _wait_snapshot(self, volatile_only: bool = False) -> None:
        ckpt = self._last
        if ckpt is None:
            return
        done = ckpt.volatile_done if volatile_only else ckpt.snapshot_done
        done.wait()
        event = ckpt.volatile_copied if volatile_only else ckpt.copied
        if event is not None:  # the training stream must not overwrite before the copy ran
            torch.cuda.current_stream().wait_event(event)

    def wait(self) -> None:
        """Block until every issued write is committed; raise the first failure."""
        for ckpt in list(self._pending):
            ckpt.done.wait()
        self._raise_failures()

    def _raise_failures(self) -> None:
        done = [c for c in self._pending if c.done.is_set()]
        self._pending = [c for c in self._pending if not c.done.is_set()]
        failed = [c for c in done if c.error is not None]
        if failed:
            first = failed[0]
            steps = ", ".join(str(c.step) for c in failed)
            if self._last_step in [c.step for c in failed]:
                self._last_step = self.index.latest()
            hint = ("; no space left on device: free space, then write again (committed steps are intact)"
                    if _disk_full(first.error) else "")
            raise CheckpointError(
                f"checkpoint of step {steps} in {self.path} failed and was not committed: "
                f"{type(first.error).__name__}: {first.error}{hint}"
            ) from first.error

    def _install_hooks(self, model: Any, optimizer: Any) -> None:
        if isinstance(model, nn.Module) and id(model) not in self._hooks:
            self._hooks[id(model)] = model.register_forward_pre_hook(
                lambda *_: self._hook_wait(volatile_only=True))
        if isinstance(optimizer, torch.optim.Optimizer) and id(optimizer) not in self._hooks:
            self._hooks[id(optimizer)] = optimizer.register_step_pre_hook(
                lambda *_: self._hook_wait())

    def _hook_wait(self, volatile_only: bool = False) -> None:
        t0 = time.perf_counter()
        self._wait_snapshot(volatile_only)
        self.blocked_seconds += time.perf_counter() - t0  # write() counts its own waits

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"the Checkpointer of {self.path} is closed")

    def close(self) -> None:
        """Wait for every write to commit, then release threads, hooks and the lock."""
        if self.closed:
            return
        try:
            self.wait()
        finally:
            self.closed = True
            for handle in self._hooks.values():
                handle.remove()
            self._hooks.clear()
            if self._snapshotter is not None:
                self._snapshotter.stop()
                self._flusher.thread.join()
            if self._flush_index is not None:
                self._flush_index.close()
            self._give_back()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the history --------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return self.index.steps()

    def truncate(self, after: int) -> list[int]:
        """Drop committed steps after ``after`` (to branch the history from there)."""
        from .retention import remove_steps

        try:
            after = _integral(after)
        except TypeError:
            raise TypeError(f"truncate(after=...) needs a step number (int), got {after!r}") from None
        self.wait()
        removed = self._on_root(
            lambda: remove_steps(self.path, self.index, [s for s in self.index.steps() if s > after]))
        self._last_step = self.index.latest()
        return removed

    def prune(self, keep_last: int | None = None, keep_every: int | None = None,
              dry_run: bool = False) -> list[int]:
        """Delete committed steps that no rule keeps (see :mod:`retention`); returns them."""
        from .retention import policies, prune_index

        rules = policies(keep_last, keep_every)
        self.wait()
        return self._on_root(lambda: prune_index(self.path, self.index, rules, dry_run))

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
                step = _integral(step)
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


_OPEN: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()


def _check_index_exists(run_dir: str) -> None:
    """Refuse to start a new index beside finished step data: the old index was
    lost, and the new one would make the writer delete every step as uncommitted."""
    if os.path.exists(index_path(run_dir)):
        return
    finished = finished_units(run_dir)
    if finished:
        raise CorruptionError(
            f"{run_dir} holds {len(finished)} step(s) of data but no index ({index_path(run_dir)} is "
            f"missing); nothing was changed. Rebuild the index with: datastates-hist repair {run_dir}"
        )


def _disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the device is full."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(exc, sqlite3.OperationalError) and "disk is full" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _close_at_exit() -> None:
    """Commit what was issued when the program ends without close()."""
    for ckpt in list(_OPEN):
        try:
            ckpt.close()
        except Exception as exc:  # the program is ending: report, do not raise
            print(f"datastates-hist: {exc}", file=sys.stderr)


def _close_first_at_exit() -> None:
    """Make :func:`_close_at_exit` the newest exit handler, so that it runs first (atexit
    runs the newest first): it must finish the flusher's writes before the storage
    libraries' own exit handlers run (h5py unregisters its type converters: a write still
    in flight then fails, or crashes the process). They register theirs when first
    imported, which may be after this module was: when a backend is first used, or
    later by the program."""
    atexit.unregister(_close_at_exit)
    atexit.register(_close_at_exit)


atexit.register(_close_at_exit)
if hasattr(threading, "_register_atexit"):
    # threading's exit callbacks run before any atexit handler (and before non-daemon
    # threads are joined): moving ours to the newest there covers every library
    # imported before the program ended. MPI's finalize (mpi4py) runs after atexit.
    threading._register_atexit(_close_first_at_exit)


def _integral(number: Any) -> int:
    """An int from any integral number (``int``, ``numpy.int64``, ...) but a bool."""
    if isinstance(number, bool):
        raise TypeError(f"{number!r} is a bool, not a number")
    return operator.index(number)


def _step_number(step: Any) -> int:
    """``step`` as an int, refused unless a whole number from 0 to :data:`MAX_STEP`."""
    try:
        step = _integral(step)
    except TypeError:
        raise ValueError(f"step must be a non-negative int, got {step!r}") from None
    if step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if step > MAX_STEP:
        raise ValueError(f"step {step} is too large: steps go up to 2**63-1 = {MAX_STEP} (a signed "
                         "64-bit integer, as the index stores them)")
    return step


def check_tensor_names(names: "tuple[str, ...] | list[str]") -> None:
    """Refuse tensor names the backends cannot store: HDF5 and ADIOS2 take ``/``-separated
    paths (HDF5 reads ``a//b`` as ``a/b`` and ``a/.`` as ``a``), in UTF-8, up to a NUL; a
    tensor cannot also be the group of others (``x`` beside ``x/y``), nor appear twice."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"two tensors are named {name!r}; rename one")
        seen.add(name)
        _check_name(name)
    for name in names:
        parent = name.rpartition("/")[0]
        while parent:
            if parent in seen:
                raise ValueError(f"tensor {parent!r} is also the group of tensor {name!r}: a name "
                                 "cannot be both a tensor and the prefix of another; rename one")
            parent = parent.rpartition("/")[0]


def _check_name(name: str, kind: str = "tensor") -> None:
    """Refuse a name with an empty, ``.`` or ``..`` component, a NUL, or no UTF-8 form."""
    for part in name.split("/"):
        if part in ("", ".", ".."):
            what = "an empty" if part == "" else f"a {part!r}"
            raise ValueError(f"{kind} {name!r} has {what} name component (between '/'), which the "
                             "backends cannot store; use keys that are not empty, '.' or '..'")
    if "\0" in name:
        raise ValueError(f"{kind} {name!r} holds a NUL character, which ends a name in the backends")
    try:
        name.encode()
    except UnicodeEncodeError:
        raise ValueError(f"{kind} {name!r} is not valid Unicode (it holds a lone surrogate)") from None


def _check_tensor(name: str, t: torch.Tensor) -> None:
    if t.layout is torch.strided and not (t.is_meta or t.is_nested) and t.dtype in STORABLE:
        return  # the common case, in a fraction of the checks below (write() runs every step)
    if t.is_meta:
        raise ValueError(f"tensor {name!r} is on the meta device and has no data to checkpoint")
    if t.is_nested:
        raise TypeError(f"tensor {name!r} is a nested tensor; only dense tensors can be checkpointed")
    if t.layout is not torch.strided:
        raise TypeError(f"tensor {name!r} has layout {t.layout}; only dense tensors can be checkpointed")
    try:
        storage_dtype(t.dtype)
    except TypeError:
        raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which cannot be stored") from None


def _check_shard(name: str, item: TensorItem) -> None:
    if (item.global_shape is None) != (item.offset is None):
        raise ValueError(f"shard {name!r} needs both global_shape and offset")
    if item.global_shape is not None:
        shape = tuple(item.tensor.shape)
        if len(item.global_shape) != len(shape) or len(item.offset) != len(shape) or any(
            o < 0 or o + n > g for o, n, g in zip(item.offset, shape, item.global_shape)
        ):
            raise ValueError(
                f"shard {name!r} of shape {list(shape)} at offset {list(item.offset)} does not fit "
                f"its global shape {list(item.global_shape)}"
            )


def _why_not_writable(path: str) -> str:
    return "read-only file system" if os.statvfs(path).f_flag & os.ST_RDONLY else "permission denied"
