"""The commit protocol, in one place.

1. The flusher has put every tensor of the step to the backend's writer.
2. ``writer.finish(manifest)`` writes the manifest (the step's records and
   plain values), fsyncs every byte and renames the step's file into place.
3. One SQLite transaction inserts the step's row and its tensor rows.

Only step 3 makes the step visible. A crash before it leaves data that no
index row names; the next writer removes it (:func:`remove_uncommitted`).

With several ranks (:func:`commit_collective`), rank 0 gathers what every
rank wrote (or why it failed), merges the blocks into global records and
broadcasts a verdict; every rank seals its bytes (durable); rank 0 publishes
the unit and commits the index only when every rank sealed; a second verdict
tells every rank the outcome. A failure anywhere leaves the step uncommitted
everywhere, and every rank reports it.
"""

from __future__ import annotations

import json
import os
import time

from .backends.base import StepWriter, remove_tree
from .digest import checksum_bytes
from .index import FORMAT_VERSION, Index, StepRow
from .items import TensorRecord


def manifest_bytes(step: int, records: list[TensorRecord], values: dict, **more) -> bytes:
    """The self-describing manifest stored inside each step's data."""
    doc = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "tensors": [r.to_json() for r in records],
        "values": values,
        **more,
    }
    return json.dumps(doc, allow_nan=True, separators=(",", ":")).encode()


def commit_step(index: Index, backend: str, step: int, writer: StepWriter,
                records: list[TensorRecord], values: dict) -> StepRow:
    manifest = manifest_bytes(step, records, values)
    location = writer.finish(manifest)
    return record_step(index, backend, step, location, records, manifest)


def record_step(index: Index, backend: str, step: int, location: str,
                records: list[TensorRecord], manifest: bytes) -> StepRow:
    row = StepRow(
        step=step, time=time.time(), backend=backend, location=location,
        nbytes=sum(r.nbytes for r in records), ntensors=len(records), tier="full",
        manifest_checksum=checksum_bytes(manifest),
    )
    index.commit_step(row, records)
    return row


class RankFailure(RuntimeError):
    """Another rank's part of a collective checkpoint failed."""


def _describe(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def commit_collective(group, index: Index | None, backend: str, ckpt, writer, records: list[TensorRecord],
                      own_values: dict) -> None:
    """Commit ``ckpt`` on every rank of ``group`` together, or on none.

    ``own_values``: the plain values only this rank holds (its RNG states);
    rank 0's values stand for every other value. ``index`` is rank 0's.
    Raises on every rank when any rank failed.
    """
    from .sharding import merge_records

    parts = not hasattr(writer, "offsets")  # one file per rank (see backends.ranks)
    mine = {"step": ckpt.step, "error": _describe(ckpt.error),
            "records": [r.to_json() for r in records] if ckpt.error is None else [], "values": own_values}
    gathered = group.gather(mine)
    verdict, manifest, merged = {"error": None}, None, []
    if group.root:
        verdict["error"] = _first_error(gathered, ckpt.step)
        if verdict["error"] is None:
            try:
                merged = merge_records([g["records"] for g in gathered], parts)
                values = {"items": dict(ckpt.values["items"]), "objects": dict(ckpt.values["objects"])}
                for g in gathered:
                    for key in ("items", "objects"):
                        values[key].update(g["values"].get(key, {}))
                manifest = manifest_bytes(ckpt.step, merged, values, world_size=group.size,
                                          layout="ranks" if parts else "shared")
            except ValueError as exc:
                verdict["error"] = f"rank 0 (merging the ranks' blocks): {exc}"
    verdict = group.bcast(verdict)
    if verdict["error"] is None:  # every rank makes its bytes durable
        try:
            writer.seal(manifest)
        except BaseException as exc:
            ckpt.fail(exc)
        sealed = group.gather(_describe(ckpt.error))
        if group.root:
            verdict["error"] = next((f"rank {r}: {e}" for r, e in enumerate(sealed) if e), None)
            if verdict["error"] is None:
                try:
                    record_step(index, backend, ckpt.step, writer.publish(), merged, manifest)
                except BaseException as exc:
                    verdict["error"] = f"rank 0 (publishing): {_describe(exc)}"
        verdict = group.bcast(verdict)
    if verdict["error"] is not None:
        _abort_all(group, writer)
        ckpt.fail(RankFailure(f"the ranks did not all write step {ckpt.step}: {verdict['error']}"))
        raise ckpt.error


def _first_error(gathered: list[dict], step: int) -> str | None:
    for rank, g in enumerate(gathered):
        if g["step"] != step:
            return (f"rank {rank} wrote step {g['step']} while rank 0 wrote step {step}: "
                    "write() must be called on every rank with the same steps")
        if g["error"]:
            return f"rank {rank} of {len(gathered)}: {g['error']}"
    return None


def _abort_all(group, writer) -> None:
    if writer is not None:
        try:
            writer.abort()
        except BaseException:
            pass
    group.barrier()
    if group.root and writer is not None and hasattr(writer, "remove"):
        writer.remove()


def remove_uncommitted(steps_dir: str, index: Index) -> list[str]:
    """Delete step data that no committed row names (left by a crash)."""
    committed = {r.location for r in index.step_rows()}
    removed = []
    for entry in sorted(os.listdir(steps_dir)):
        if entry not in committed:
            remove_tree(os.path.join(steps_dir, entry))
            removed.append(entry)
    return removed
