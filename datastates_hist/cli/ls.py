"""``datastates-hist ls RUN``: the committed steps of a run.

Each step's kind (``restore``: a step restore() reads back; ``trajectory``: a
step that keeps only the trajectory's tensors) and its tensor bytes, as they
are and as stored. Reads only the index (no tensor reader, no torch), so it
prints at once.
"""

from __future__ import annotations

from ..index import Index, open_existing
from . import add_command
from .output import add_json_flag, emit, size, when


def add_parser(sub):
    return add_run_command(sub, "ls", "list the committed steps of a run")


def add_run_command(sub, name: str, help_text: str):
    """The parser of a command that reads one run: ``RUN [--json]``."""
    cmd = add_command(sub, name, help=help_text)
    cmd.add_argument("run", help="the run directory")
    add_json_flag(cmd)
    return cmd


def run(args) -> int:
    index = open_existing(args.run)
    try:
        rows = index.step_rows()
        stored = stored_by_step(index)
    finally:
        index.close()
    data = [{"step": r.step, "time": r.time, "kind": kind(r.tier), "bytes": r.nbytes,
             "stored": stored.get(r.step, 0), "tensors": r.ntensors, "backend": r.backend,
             "location": r.location} for r in rows]
    # the backend (one per run, in --json) leaves the table room to fit 80 columns
    table = [[str(r.step), when(r.time), kind(r.tier), size(r.nbytes), size(stored.get(r.step, 0)),
              str(r.ntensors)] for r in rows]
    emit(args, ["step", "time", "kind", "bytes", "stored", "tensors"], table, data, left=("time", "kind"))
    return 0


def kind(tier: str) -> str:
    """What a step is, by its index tier: a restore point (``full`` or ``restore``:
    restore() reads it back) or a trajectory point."""
    return "trajectory" if tier == "trajectory" else "restore"


def stored_by_step(index: Index) -> dict[int, int]:
    """step -> the bytes its tensors take as stored (0 for a step without tensors)."""
    stored: dict[int, int] = {}
    for step, _group, _encoding, _nbytes, nstored in index.stored_bytes():
        stored[step] = stored.get(step, 0) + nstored
    return stored


