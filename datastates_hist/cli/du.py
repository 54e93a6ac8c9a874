"""``datastates-hist du RUN``: where a run's bytes go.

The tensor bytes of every committed step, as stored and as they are (raw), with
the ratio stored/raw: by kind of step (restore points, trajectory points), by
tensor group (``model/``, ``optim/``, the rest) and by encoding (raw, key,
delta); then the total and the bytes the step units take on disk (the rest of
which is metadata: manifests, the backend's own). A tensor rounded to
``keep_bits`` counts its rounded value and, in a restore point, its low bits
(kept in the restore unit) as its stored bytes. Reads only the index and the
sizes of the units (no tensor reader, no torch).
"""

from __future__ import annotations

import os

from ..items import ENCODINGS
from ..layout import finished_units, restore_unit, steps_dir, unit_bytes
from ..index import open_existing
from .ls import add_run_command, kind
from .output import emit, size

KINDS = {"restore": "restore points", "trajectory": "trajectory points"}
GROUPS = {"model/": "model", "optim/": "optimizer"}
OTHER = "other"


def add_parser(sub):
    return add_run_command(sub, "du", "show the bytes a run takes, by kind of step, tensor group and encoding")


def run(args) -> int:
    index = open_existing(args.run)
    try:
        rows = index.step_rows()
        sums = index.stored_bytes()
    finally:
        index.close()
    disk = disk_bytes(args.run, rows)
    kind_of = {r.step: kind(r.tier) for r in rows}
    totals = {"kinds": {k: [0, 0] for k in KINDS}, "groups": {g: [0, 0] for g in [*GROUPS.values(), OTHER]},
              "encodings": {e: [0, 0] for e in ENCODINGS}}
    for step, group, encoding, nbytes, stored in sums:
        if step not in kind_of:
            continue  # committed after the steps were listed
        for by, key in (("kinds", kind_of[step]), ("groups", GROUPS.get(group, OTHER)), ("encodings", encoding)):
            counts = totals[by].setdefault(key, [0, 0])  # an encoding of a newer version too
            counts[0] += stored
            counts[1] += nbytes
    stored, raw = (sum(counts[i] for counts in totals["kinds"].values()) for i in (0, 1))
    data = {"run": args.run, "steps": len(rows),
            **{by: {key: _figures(*counts) for key, counts in parts.items()} for by, parts in totals.items()},
            "total": _figures(stored, raw), "disk": disk, "metadata": disk - stored}
    table = []
    for by, parts in totals.items():
        for i, (key, (part_stored, part_raw)) in enumerate(parts.items()):
            table.append([by.removesuffix("s") if i == 0 else "", KINDS.get(key, key) if by == "kinds" else key,
                          size(part_stored), size(part_raw), _shown(_ratio(part_stored, part_raw))])
    table += [["total", "", size(stored), size(raw), _shown(_ratio(stored, raw))],
              ["on disk", "", size(disk), "", _shown(_ratio(disk, raw))],
              ["metadata", "", size(disk - stored), "", ""]]
    emit(args, ["by", "what", "stored", "raw", "stored/raw"], table, data, left=("by", "what"))
    return 0


def disk_bytes(run_dir: str, rows) -> int:
    """The bytes of the units of the committed steps ``rows`` (both units of a restore
    point). Only entries listed in ``steps/`` are counted: a name read from the index
    is matched against them, never opened as a path (which would need the backend's
    check of it, and so its packages)."""
    named = {r.location for r in rows} | {restore_unit(r.location) for r in rows if r.tier == "restore"}
    total = 0
    for entry in finished_units(run_dir):
        if entry in named:
            try:
                total += unit_bytes(os.path.join(steps_dir(run_dir), entry))
            except FileNotFoundError:
                pass  # removed by the run's writer since the listing (retention): it takes nothing now
    return total


def _figures(stored: int, raw: int) -> dict:
    return {"stored": stored, "raw": raw, "ratio": _ratio(stored, raw)}


def _shown(ratio: float | None) -> str:
    return "" if ratio is None else f"{ratio:.3f}"


def _ratio(stored: int, raw: int) -> float | None:
    """stored/raw; None (printed blank) where there is nothing raw."""
    return stored / raw if raw else None
