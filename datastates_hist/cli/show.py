"""``datastates-hist show RUN STEP``: the tensors of one step, with statistics from the index.

Per tensor: its shape, dtype, how it is stored (``raw``, ``key``: compressed alone,
``delta<-B``: against its value at step B), its bytes as they are and as stored,
and its norm (the table leaves min and max, in ``--json``, to fit 80 columns). A
tensor that reads rounded to ``keep_bits`` (a lossy trajectory point's) has a ``*`` after its
encoding (``delta<-12*``; one character, so that names keep their room in 80
columns), and a line under the table gives the bits kept and the relative error
bound, ``2**-(bits+1)`` (``--json``: ``keep_bits`` and ``bound`` per tensor, null
for a tensor that reads exact). A restore point's tensors read exact: the low bits
of those its trajectory point will keep rounded lie in its restore unit (``--json``:
``low_stored``), and their stored bytes count them.
"""

from __future__ import annotations

from . import STEP_HELP, add_command, resolve_step, step_choice
from .output import add_json_flag, emit, size


def add_parser(sub):
    cmd = add_command(sub, "show", help="list the tensors of one step")
    cmd.add_argument("run", help="the run directory")
    cmd.add_argument("step", type=step_choice, help=STEP_HELP)
    cmd.add_argument("--names", action="append", metavar="GLOB",
                     help="only tensors matching GLOB ('model/' may be left out); repeatable")
    add_json_flag(cmd)
    return cmd


def run(args) -> int:
    from ..items import selected
    from ..store import Store

    store = Store(args.run)
    try:
        step = resolve_step(store, args.step)
        records = store.records(step)
    finally:
        store.close()
    if args.names:
        chosen = selected([r.name for r in records], args.names)
        unmatched = [glob for glob, found in chosen.items() if not found]
        if unmatched:
            raise KeyError(f"no tensor of step {step} of {args.run} matches {', '.join(unmatched)}")
        wanted = set().union(*chosen.values())
        records = [r for r in records if r.name in wanted]
    data = [{"name": r.name, "shape": list(r.shape), "dtype": r.dtype, "nbytes": r.nbytes,
             "encoding": r.encoding, "base": r.base, "stored": stored(r), "update_ratio": r.update_ratio,
             "checksum": r.checksum, "keep_bits": r.rounded_bits,
             "bound": r.rounded_bound,
             "exact_checksum": r.exact_checksum, "low_stored": r.low_stored, **r.stats} for r in records]
    columns = ["name", "shape", "dtype", "encoding", "nbytes", "stored", "norm"]
    table = [[r.name, "x".join(map(str, r.shape)) or "()", r.dtype, encoding(r), size(r.nbytes),
              size(stored(r)), r.stats.get("norm")] for r in records]
    emit(args, columns, table, data, left=("name", "dtype", "encoding"), gives_way=("dtype", "encoding", "nbytes"))
    if not args.json:
        note = rounding_note(records)
        if note:
            print(f"* {note}")
    return 0


def rounding_note(records) -> str | None:
    """``rounded to 8 mantissa bits (relative error at most 0.00195)`` for the tensors of
    ``records`` that read rounded (one Trajectory rounds a step: one keep_bits); None if none."""
    bounds = sorted({(r.rounded_bits, r.rounded_bound) for r in records if r.rounded_bits is not None}, reverse=True)
    if not bounds:
        return None
    return "rounded to " + ", ".join(f"{bits} mantissa bits (relative error at most {bound:.3g})"
                                     for bits, bound in bounds)


def stored(rec) -> int:
    """The bytes a tensor takes: in its unit, and its low bits in the restore unit."""
    return rec.stored_bytes + (rec.low_stored or 0)


def encoding(rec) -> str:
    """How a tensor is stored, its base step beside a delta's: ``delta<-12``."""
    how = f"delta<-{rec.base}" if rec.encoding == "delta" else rec.encoding
    return how if rec.rounded_bits is None else f"{how}*"
