"""``datastates-hist show RUN STEP``: the tensors of one step, with statistics from the index."""

from __future__ import annotations

from . import STEP_HELP, resolve_step, step_choice
from .output import add_json_flag, emit


def add_parser(sub):
    cmd = sub.add_parser("show", help="list the tensors of one step")
    cmd.add_argument("run", help="the run directory")
    cmd.add_argument("step", type=step_choice, help=STEP_HELP)
    cmd.add_argument("--names", action="append", metavar="GLOB",
                     help="only tensors matching GLOB ('model/' may be left out); repeatable")
    add_json_flag(cmd)
    return cmd


def run(args) -> int:
    from ..items import matches
    from ..store import Store

    store = Store(args.run)
    try:
        step = resolve_step(store, args.step)
        records = store.records(step)
    finally:
        store.close()
    if args.names:
        unmatched = [glob for glob in args.names if not any(matches(r.name, [glob]) for r in records)]
        if unmatched:
            raise KeyError(f"no tensor of step {step} of {args.run} matches {', '.join(unmatched)}")
        records = [r for r in records if matches(r.name, args.names)]
    data = [{"name": r.name, "shape": list(r.shape), "dtype": r.dtype, "nbytes": r.nbytes,
             "checksum": r.checksum, **r.stats} for r in records]
    table = [[r.name, "x".join(map(str, r.shape)) or "()", r.dtype,
              *(r.stats.get(key) for key in ("norm", "min", "max"))] for r in records]
    emit(args, ["name", "shape", "dtype", "norm", "min", "max"], table, data, left=("name", "dtype"))
    return 0
