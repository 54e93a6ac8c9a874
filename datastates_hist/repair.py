"""Rebuild a run's index from its step data.

Each step unit in ``RUN/steps/`` is self-describing: its ``__manifest__``
holds the step number, the format version, every tensor record and the plain
values. So a damaged or lost ``index.sqlite`` can be rebuilt:

1. take the writer lock (no writer may run meanwhile);
2. move the old index (and its ``-wal``/``-shm`` files) aside as
   ``index.sqlite.damaged-<time>``;
3. create a new index and commit one row per unit whose manifest parses and
   whose tensors all match their checksums, in step order. Commit times are
   taken from the old index where it can still be read, else from the unit's
   modification time.

Units that cannot be committed (damaged, of a newer format, a second unit of
the same step) are moved to ``RUN/damaged/``, never deleted, so that a later
writer does not remove them as uncommitted. ``.partial`` units were never
committed and are left for the next writer to remove.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass, field

from .backends import get_backend
from .checkpointer import _take_lock
from .digest import checksum_bytes
from .errors import CorruptionError, FormatError, StoreNotFoundError
from .index import FORMAT_VERSION, Index, StepRow, index_path
from .items import TensorRecord
from .store import StepData, steps_dir

DAMAGED_DIR = "damaged"
BACKEND_OF_SUFFIX = {".bp": "adios2", ".h5": "hdf5"}


@dataclass
class RepairReport:
    """What :func:`repair_run` found and did.

    Attributes:
        diagnosis: why the index was rebuilt, or why nothing was done.
        rebuilt: whether a new index was written.
        moved_index: where the old index was moved, if it was.
        steps: the steps committed in the new index.
        set_aside: unit -> why it could not be committed (moved to ``RUN/damaged/``).
        lost: steps the old index named that have no data at all.
    """

    diagnosis: str
    rebuilt: bool = False
    moved_index: str | None = None
    steps: list[int] = field(default_factory=list)
    set_aside: dict[str, str] = field(default_factory=dict)
    lost: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def diagnose(run_dir: str) -> str | None:
    """Why the index of ``run_dir`` needs rebuilding, or None when it is healthy:
    it opens, every row's data exists, and every finished unit has a row."""
    try:
        index = Index(run_dir)
    except StoreNotFoundError:
        return f"{index_path(run_dir)} is missing"
    except CorruptionError as exc:
        return str(exc)
    except FormatError as exc:
        if "upgrade datastates-hist" in str(exc):  # a newer format: not ours to rewrite
            raise
        return str(exc)
    try:
        named = {r.location for r in index.step_rows()}
    except sqlite3.DatabaseError as exc:
        return f"the index {index.path} is damaged ({exc})"
    finally:
        index.close()
    units = set(_units(run_dir))
    if named - units:
        return f"the index names step data that is missing: {', '.join(sorted(named - units))}"
    if units - named:
        return f"step data that the index does not name: {', '.join(sorted(units - named))}"
    return None


def repair_run(run_dir: str, force: bool = False, verify: bool = True) -> RepairReport:
    """Rebuild the index of ``run_dir`` from its step units when it is damaged.

    Args:
        run_dir: the run directory.
        force: rebuild even when the index looks healthy.
        verify: read every tensor and check its checksum before committing its
            step (slow for large runs, but a step is committed only if intact).

    Raises:
        StoreNotFoundError: ``run_dir`` has no ``steps/`` folder.
        StoreLockedError: a writer holds the run.
        FormatError: the run was written by a newer datastates-hist.
    """
    run_dir = os.fspath(run_dir)
    if not os.path.isdir(steps_dir(run_dir)):
        raise StoreNotFoundError(f"no run at {run_dir} (no steps/ folder)")
    lock_fd = _take_lock(run_dir)
    try:
        diagnosis = diagnose(run_dir)
        if diagnosis is None and not force:
            return RepairReport("the index is healthy; nothing to repair (use --force to rebuild it anyway)")
        report = RepairReport(diagnosis or "rebuilt on request (--force)", rebuilt=True)
        old_times = _old_commit_times(run_dir)
        found, bad = _scan(run_dir, old_times, verify)  # reads only: nothing is changed yet
        report.moved_index = _move_index_aside(run_dir)
        for unit, why in bad:
            _set_aside(run_dir, unit, why, report)
        _write_index(run_dir, found, report)
        with_data = {int(u.split(".")[0]) for u in _units(run_dir) + list(report.set_aside)
                     if u.split(".")[0].isdigit()}
        report.lost = sorted(set(old_times) - with_data)
        return report
    finally:
        os.close(lock_fd)


def _units(run_dir: str) -> list[str]:
    """Finished step units (not ``.partial``) in ``steps/``, sorted."""
    return sorted(e for e in os.listdir(steps_dir(run_dir)) if not e.endswith(".partial"))


def _old_commit_times(run_dir: str) -> dict[int, float]:
    """step -> commit time, from whatever of the old index can still be read."""
    path = index_path(run_dir)
    if not os.path.exists(path):
        return {}
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return {int(s): float(t) for s, t in conn.execute("SELECT step, time FROM steps")}
        finally:
            conn.close()
    except (sqlite3.Error, ValueError, TypeError):
        return {}


def _move_index_aside(run_dir: str) -> str | None:
    """Rename the index and its WAL files to ``index.sqlite.damaged-<time>``; the
    WAL must go too, or the new index would replay the old one's log."""
    path = index_path(run_dir)
    if not os.path.exists(path):
        for side in ("-wal", "-shm"):  # orphans of a lost index
            if os.path.exists(path + side):
                os.remove(path + side)
        return None
    aside = f"{path}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
    while os.path.exists(aside):
        aside += "x"
    for side in ("", "-wal", "-shm"):
        if os.path.exists(path + side):
            os.rename(path + side, aside + side)
    return aside


def _scan(run_dir: str, old_times: dict[int, float], verify: bool):
    """Read every finished unit: ``(found, bad)``, found as ``(row, records)``
    in step order, bad as ``(unit, why)``."""
    found: dict[int, tuple[StepRow, list[TensorRecord]]] = {}
    bad: list[tuple[str, str]] = []
    for unit in _units(run_dir):
        try:
            row, records = _read_unit(run_dir, unit, old_times, verify)
        except ImportError:
            raise  # a missing backend package says nothing about the data
        except Exception as exc:  # a damaged unit may fail in any way its library chooses
            bad.append((unit, str(exc)))
            continue
        if row.step in found:
            bad.append((unit, f"a second unit of step {row.step}"))
            continue
        found[row.step] = (row, records)
    return [found[s] for s in sorted(found)], bad


def _write_index(run_dir: str, found, report: RepairReport) -> None:
    backends = [row.backend for row, _ in found]
    main = max(set(backends), key=backends.count) if backends else "adios2"
    index = Index(run_dir, create=True, backend=main)
    try:
        for row, records in found:
            index.commit_step(row, records)
            report.steps.append(row.step)
    finally:
        index.close()


def _read_unit(run_dir: str, unit: str, old_times: dict[int, float],
               verify: bool) -> tuple[StepRow, list[TensorRecord]]:
    """The index row and records of one unit, from its manifest; raises if damaged."""
    stem, suffix = os.path.splitext(unit)
    if suffix not in BACKEND_OF_SUFFIX or not stem.isdigit():
        raise ValueError(f"not a step unit (expected <step>{'|'.join(BACKEND_OF_SUFFIX)})")
    backend = BACKEND_OF_SUFFIX[suffix]
    reader = get_backend(backend).open_step(steps_dir(run_dir), unit)
    try:
        raw = reader.manifest()
        doc = json.loads(raw)
        if int(doc["format_version"]) > FORMAT_VERSION:
            raise FormatError(f"written in format version {doc['format_version']}; "
                              f"this datastates-hist writes up to {FORMAT_VERSION}")
        if doc["step"] != int(stem):
            raise CorruptionError(f"its manifest is of step {doc['step']}, its name says {int(stem)}")
        records = [TensorRecord.from_json(r) for r in doc["tensors"]]
        row = StepRow(
            step=int(stem), time=old_times.get(int(stem), _mtime(run_dir, unit)), backend=backend,
            location=unit, nbytes=sum(r.nbytes for r in records), ntensors=len(records),
            tier="full", manifest_checksum=checksum_bytes(raw),
        )
        data = StepData(run_dir, row, reader)
        if verify:
            for name in data.records:
                data.read(name)  # raises CorruptionError naming the tensor
        return row, records
    finally:
        reader.close()


def _mtime(run_dir: str, unit: str) -> float:
    return os.path.getmtime(os.path.join(steps_dir(run_dir), unit))


def _set_aside(run_dir: str, unit: str, why: str, report: RepairReport) -> None:
    """Move a unit that cannot be committed to ``RUN/damaged/`` (kept, not deleted)."""
    folder = os.path.join(run_dir, DAMAGED_DIR)
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(folder, unit)
    while os.path.exists(target):
        target += "x"
    os.rename(os.path.join(steps_dir(run_dir), unit), target)
    report.set_aside[unit] = why
