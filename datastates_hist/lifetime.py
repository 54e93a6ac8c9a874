"""Checkpointers and the life of their process: committed at exit, left alone by fork.

At exit, a Checkpointer the program did not close commits what was issued (its
threads would be stopped mid-write otherwise). A child made by ``fork`` (a
DataLoader worker, say) has none of the parent's threads: a Checkpointer it
inherits is left alone there, and the child's copy of the writer lock is closed
at once, so that the parent's ``close()`` gives the run back even while the child
lives (a ``flock`` is held until every descriptor sharing it is closed).

The Checkpointers tracked here implement ``path``, ``close()``, ``closed`` and ``inherited()``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

# Held strongly until the lock is given back and nothing is left to report: a Checkpointer
# the program dropped without closing it still has steps in flight, which the exit handler
# commits; one whose close() was interrupted finishes them, and the exit handler waits.
_HOLDING: set = set()


def hold(ckpt) -> None:
    """``ckpt`` holds its run's writer lock (until :func:`release`)."""
    _HOLDING.add(ckpt)
    _close_first_at_exit()  # the backend's library may have registered its exit handler just now


def release(ckpt) -> None:
    _HOLDING.discard(ckpt)


def finishing(path: str) -> bool:
    """Whether a Checkpointer of ``path`` in this process still writes after an interrupted close()."""
    return any(ckpt.closed and ckpt.path == path for ckpt in list(_HOLDING))


def _close_at_exit() -> None:
    """Commit what was issued when the program ends without close(), or finish what an
    interrupted close() left (a third Ctrl-C gives up waiting)."""
    for ckpt in list(_HOLDING):
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


def _after_fork_in_child() -> None:
    for ckpt in list(_HOLDING):
        ckpt.inherited()
    _HOLDING.clear()


atexit.register(_close_at_exit)
if hasattr(threading, "_register_atexit"):
    # threading's exit callbacks run before any atexit handler (and before non-daemon
    # threads are joined): moving ours to the newest there covers every library
    # imported before the program ended. MPI's finalize (mpi4py) runs after atexit.
    threading._register_atexit(_close_first_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
