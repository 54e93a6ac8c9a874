"""The commit protocol, in one place.

1. The flusher has put every tensor of the step to the backend's writer.
2. ``writer.finish(manifest)`` writes the manifest (the step's records and
   plain values), fsyncs every byte and renames the step's file into place.
3. One SQLite transaction inserts the step's row and its tensor rows.

Only step 3 makes the step visible. A crash before it leaves data that no
index row names; the next writer removes it (:func:`remove_uncommitted`).
"""

from __future__ import annotations

import json
import os
import time

from .backends.base import StepWriter, remove_tree
from .digest import checksum_bytes
from .index import FORMAT_VERSION, Index, StepRow
from .items import TensorRecord


def manifest_bytes(step: int, records: list[TensorRecord], values: dict) -> bytes:
    """The self-describing manifest stored inside each step's data."""
    doc = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "tensors": [r.to_json() for r in records],
        "values": values,
    }
    return json.dumps(doc, allow_nan=True, separators=(",", ":")).encode()


def commit_step(index: Index, backend: str, step: int, writer: StepWriter,
                records: list[TensorRecord], values: dict) -> StepRow:
    manifest = manifest_bytes(step, records, values)
    location = writer.finish(manifest)
    row = StepRow(
        step=step, time=time.time(), backend=backend, location=location,
        nbytes=sum(r.nbytes for r in records), ntensors=len(records), tier="full",
        manifest_checksum=checksum_bytes(manifest),
    )
    index.commit_step(row, records)
    return row


def remove_uncommitted(steps_dir: str, index: Index) -> list[str]:
    """Delete step data that no committed row names (left by a crash)."""
    committed = {r.location for r in index.step_rows()}
    removed = []
    for entry in sorted(os.listdir(steps_dir)):
        if entry not in committed:
            remove_tree(os.path.join(steps_dir, entry))
            removed.append(entry)
    return removed
