"""``datastates-hist show RUN STEP``: the tensors of one step, with statistics from the index."""

from __future__ import annotations

from ..store import Store
from . import step_number
from .output import add_json_flag, emit, num


def add_parser(sub):
    cmd = sub.add_parser("show", help="list the tensors of one step")
    cmd.add_argument("run", help="the run directory")
    cmd.add_argument("step", type=step_number, help="a committed step")
    add_json_flag(cmd)
    return cmd


def run(args) -> int:
    store = Store(args.run)
    try:
        records = store.records(args.step)
    finally:
        store.close()
    data = [{"name": r.name, "shape": list(r.shape), "dtype": r.dtype, "nbytes": r.nbytes,
             "checksum": r.checksum, **r.stats} for r in records]
    table = [[r.name, "x".join(map(str, r.shape)) or "()", r.dtype, num(r.stats.get("norm")),
              num(r.stats.get("min")), num(r.stats.get("max"))] for r in records]
    emit(args, ["name", "shape", "dtype", "norm", "min", "max"], table, data, left=("name", "dtype"))
    return 0
