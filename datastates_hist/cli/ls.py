"""``datastates-hist ls RUN``: the committed steps of a run."""

from __future__ import annotations

from ..store import Store
from .output import add_json_flag, emit, size, when


def add_parser(sub):
    cmd = sub.add_parser("ls", help="list the committed steps of a run")
    cmd.add_argument("run", help="the run directory")
    add_json_flag(cmd)
    return cmd


def run(args) -> int:
    store = Store(args.run)
    try:
        rows = store.index.step_rows()
    finally:
        store.close()
    data = [{"step": r.step, "time": r.time, "bytes": r.nbytes, "tensors": r.ntensors,
             "backend": r.backend, "location": r.location} for r in rows]
    table = [[str(r.step), when(r.time), size(r.nbytes), str(r.ntensors), r.backend] for r in rows]
    emit(args, ["step", "time", "bytes", "tensors", "backend"], table, data, left=("time", "backend"))
    return 0
