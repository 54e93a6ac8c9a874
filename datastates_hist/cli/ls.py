"""``datastates-hist ls RUN``: the committed steps of a run.

Reads only the index (no tensor reader, no torch), so it prints at once.
"""

from __future__ import annotations

import os

from ..errors import StoreNotFoundError
from ..index import Index
from .output import add_json_flag, emit, size, when


def add_parser(sub):
    cmd = sub.add_parser("ls", help="list the committed steps of a run")
    cmd.add_argument("run", help="the run directory")
    add_json_flag(cmd)
    return cmd


def run(args) -> int:
    index = open_index(args.run)
    try:
        rows = index.step_rows()
    finally:
        index.close()
    data = [{"step": r.step, "time": r.time, "bytes": r.nbytes, "tensors": r.ntensors,
             "backend": r.backend, "location": r.location} for r in rows]
    table = [[str(r.step), when(r.time), size(r.nbytes), str(r.ntensors), r.backend] for r in rows]
    emit(args, ["step", "time", "bytes", "tensors", "backend"], table, data, left=("time", "backend"))
    return 0


def open_index(run_dir: str) -> Index:
    """The index of a run, opened for reading, for the commands that need no tensor
    (the same errors as :class:`~datastates_hist.store.Store`, without importing torch)."""
    if not os.path.isdir(run_dir):
        raise StoreNotFoundError(f"no run at {run_dir}")
    return Index(run_dir)
