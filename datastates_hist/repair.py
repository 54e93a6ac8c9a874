"""Rebuild a run's index from its step data.

Each step unit in ``RUN/steps/`` is self-describing: its ``__manifest__``
holds the step number, the format version, every tensor record and the plain
values. So a damaged or lost ``index.sqlite`` can be rebuilt:

1. take the writer lock (no writer may run meanwhile), and remove what a
   killed repair left (``RUN/index.sqlite.rebuilding/``);
2. build the new index aside, in ``RUN/index.sqlite.rebuilding/index.sqlite``:
   one row per unit whose manifest parses and whose tensors all match their
   checksums, with the step's scalars (:mod:`.scalars`, from the manifest's
   values, as a commit records them). Commit times are taken from the old
   index where it can still be read, else from the unit's modification time.
   Nothing of the run is changed yet, so a repair killed here leaves the run
   as it was;
3. fsync the new index (one file: its journal mode is DELETE, no ``-wal``),
   move units that cannot be committed to ``RUN/damaged/``, move the old
   index aside, rename the new one into place and fsync the run folder.
   Killed between the last two renames, the run has no index, and writers
   refuse it until the next repair.

A damaged old index is kept for inspection as ``index.sqlite.damaged-<time>``
(with its ``-wal`` and ``-shm`` files, as they were). A healthy one, rebuilt on
request (``force``), is kept as one file, ``index.sqlite.previous``, its WAL
folded in first; the next such repair replaces it, so repeated repairs leave
no clutter.

The new index's ``created`` time is that of the repair, after every unit it
names was written: a later writer refuses to delete a finished unit the index
does not name and that is older than the index (see
:func:`datastates_hist.commit.remove_uncommitted`).

A step may have two units (format version 2): its main unit ``<step><suffix>``
and a restore unit ``<step>.restore<suffix>`` (:func:`.layout.restore_unit`),
whose manifest checksum the main unit's manifest records (``restore_unit``).
Its row is a restore point (tier ``restore``, the tensors of both units) when
both are intact; a trajectory point (``trajectory``, the main unit's tensors)
when its restore unit is gone (a demotion cut short after the index changed,
or a deleted unit) or cannot be committed; a main unit that names no restore
unit is a ``full`` step. A tensor rounded to ``keep_bits`` keeps the checksum
of its exact bytes and the size of its low bits (``exact_checksum``,
``low_stored``) in a restore point's row, and drops them in a trajectory
point's, as a demotion does; its low bits are checked with the restore unit.
Units are read in step order: a tensor stored as a
delta is decoded against its base (the same tensor at an earlier step), served
from the units this repair has already accepted; a delta whose base step has
no accepted unit makes its unit damaged.

Units that cannot be committed (damaged, of a newer format, a second unit of
the same step, a step number the index cannot hold, a symbolic link out of
``steps/``, a restore unit without its intact main unit) are moved to
``RUN/damaged/``, never deleted, so that a later writer does not remove them
as uncommitted. To try one again (say, after a fix of the library), move it
back into ``RUN/steps/`` and run repair again. ``.partial`` units were never
committed and are left for the next writer to remove.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np

from .backends import backend_names, get_backend
from .digest import checksum_bytes
from .durable import fsync_dir, fsync_path, remove_tree, rename_into_place
from .errors import CorruptionError, FormatError, StoreNotFoundError
from .index import MAX_TIME, Index, StepRow
from .items import TensorRecord
from .layout import (DAMAGED_DIR, MAX_STEP, RANKS_SUFFIX, REBUILDING_DIR, file_not_run, finished_units,
                     index_path, main_of_restore_unit, rank_file, restore_unit, step_of_unit, steps_dir,
                     take_writer_lock)
from .scalars import scalars_of
from .values import as_current
from .step_data import StepData, manifest_version
from .store import DECODED_PER_TENSOR

PREVIOUS_INDEX_SUFFIX = ".previous"  # the healthy index a forced repair replaced: RUN/index.sqlite.previous
_SQLITE_FILES = ("", "-wal", "-shm")  # an SQLite database's main file and its WAL files, by suffix


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
        leftover_removed: whether a new index left by a killed repair was removed.
        in_damaged: what ``RUN/damaged/`` holds (set aside by this repair or an earlier one).
    """

    diagnosis: str
    rebuilt: bool = False
    moved_index: str | None = None
    steps: list[int] = field(default_factory=list)
    set_aside: dict[str, str] = field(default_factory=dict)
    lost: list[int] = field(default_factory=list)
    leftover_removed: bool = False
    in_damaged: list[str] = field(default_factory=list)

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
        named = set()
        for row in index.step_rows():
            named.add(row.location)
            if row.tier == "restore":
                named.add(restore_unit(row.location))
        index.scalar_rows()  # each a number
    except CorruptionError as exc:  # a row SQLite cannot read, or one holding what no commit writes
        return str(exc)
    finally:
        index.close()
    units = set(finished_units(run_dir))
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
        ImportError: a unit needs a backend whose package is not installed
            (nothing was changed).
    """
    run_dir = os.fspath(run_dir)
    if not os.path.isdir(steps_dir(run_dir)):
        raise StoreNotFoundError(f"no run at {run_dir} ({file_not_run(run_dir) or 'no steps/ folder'})")
    lock_fd = take_writer_lock(run_dir)
    try:
        leftover_removed = _remove_rebuilding(run_dir)
        diagnosis = diagnose(run_dir)
        if diagnosis is None and not force:
            report = RepairReport("the index is healthy; nothing to repair (use --force to rebuild it anyway)")
        else:
            report = RepairReport(diagnosis or "rebuilt on request (--force)", rebuilt=True)
            old_times, old_backend = _from_old_index(run_dir)
            # the run is unchanged so far
            new_index, report.steps, bad = _build_aside(run_dir, old_times, old_backend, verify)
            for unit, why in bad:
                _set_aside(run_dir, unit, why, report)
            report.moved_index = _swap_in(run_dir, new_index, healthy=diagnosis is None)
            with_data = {step_of_unit(u) for u in finished_units(run_dir) + list(report.set_aside)} - {None}
            report.lost = sorted(set(old_times) - with_data)
        report.leftover_removed = leftover_removed
        report.in_damaged = _in_damaged(run_dir)
        return report
    finally:
        os.close(lock_fd)


def _unit_order(unit: str) -> tuple:
    """Units by step number (names without one last), so that delta bases come first."""
    step = step_of_unit(unit)
    return (step is None, step or 0, unit)


def _in_damaged(run_dir: str) -> list[str]:
    folder = os.path.join(run_dir, DAMAGED_DIR)
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def _from_old_index(run_dir: str) -> tuple[dict[int, float], str | None]:
    """``(step -> commit time, the run's backend)``, from whatever of the old index can
    still be read."""
    path = index_path(run_dir)
    if not os.path.exists(path):
        return {}, None
    times, backend = {}, None
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error:
        return times, backend
    try:
        try:
            # a time that is no time (damage the rebuild is for) gives way to the unit's
            times = {s: float(t) for s, t in conn.execute("SELECT step, time FROM steps").fetchall()
                     if type(s) is int and isinstance(t, (int, float)) and 0 <= t < MAX_TIME}
        except (sqlite3.Error, ValueError, TypeError):
            pass
        try:
            named = conn.execute("SELECT value FROM meta WHERE key='backend'").fetchall()
            backend = named[0][0] if named and isinstance(named[0][0], str) else None
        except sqlite3.Error:
            pass
    finally:
        conn.close()
    return times, backend


# --- building the new index aside -----------------------------------------------------------

def _remove_rebuilding(run_dir: str) -> bool:
    """Remove the half-built index of a killed repair (with its journal); whether there was one."""
    folder = os.path.join(run_dir, REBUILDING_DIR)
    if not os.path.lexists(folder):
        return False
    remove_tree(folder)
    return True


def _build_aside(run_dir: str, old_times: dict[int, float], old_backend: str | None, verify: bool):
    """Write the new index in ``RUN/index.sqlite.rebuilding/``, one row per intact unit
    as it is read: ``(its path, the steps committed, [(unit, why) for the units that
    cannot be committed])``. The run's backend (what later writers use) stays the old
    index's where it names one this installation has, else is the one most steps use."""
    units = finished_units(run_dir)
    backends = _backends_by_suffix()
    known = [b for b in (_backend_of(run_dir, u, backends, strict=False) for u in units) if b]
    main = (old_backend if old_backend in backends[0].values() else
            Counter(known).most_common(1)[0][0] if known else "adios2")
    folder = os.path.join(run_dir, REBUILDING_DIR)
    os.mkdir(folder)
    try:
        index = Index(folder, create=True, backend=main)
        try:
            # one file that travels alone (no -wal); fsynced once, whole, before it is renamed in
            index.conn.execute("PRAGMA journal_mode=DELETE")
            index.conn.execute("PRAGMA synchronous=OFF")
            steps, bad = _commit_units(run_dir, index, units, backends, old_times, verify)
        finally:
            index.close()
        fsync_path(index_path(folder))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return index_path(folder), steps, bad


def _commit_units(run_dir: str, index: Index, units: list[str], backends, old_times: dict[int, float],
                  verify: bool) -> tuple[list[int], list[tuple[str, str]]]:
    """Commit each step whose main unit is intact, in step order (with its restore unit
    when that is intact too); ``(the steps committed, [(unit, why) not committed]``."""
    bad: list[tuple[str, str]] = []
    bases = _AcceptedUnits(run_dir)
    restores = {main: unit for unit in units if (main := main_of_restore_unit(unit)) is not None}
    for unit in sorted((u for u in units if main_of_restore_unit(u) is None), key=_unit_order):
        restore = restores.pop(unit, None)
        try:
            row, records, scalars, restore_checksum = _read_unit(run_dir, unit, backends, old_times, verify,
                                                                 bases)
            if row.step in bases.rows:
                raise ValueError(f"a second unit of step {row.step}")
        except ImportError:
            raise  # a missing backend package says nothing about the data
        except Exception as exc:  # a damaged unit may fail in any way its library chooses
            bases.reject()
            bad.append((unit, str(exc)))
            if restore is not None:
                bad.append((restore, f"a restore unit whose main unit {unit} cannot be committed"))
            continue
        if restore is not None:
            try:
                if restore_checksum is None:
                    raise ValueError(f"its main unit {unit} names no restore unit (a step of one unit)")
                restored = _read_restore_unit(run_dir, row, restore, restore_checksum, verify, bases)
                row = replace(row, tier="restore", nbytes=row.nbytes + sum(r.nbytes for r in restored),
                              ntensors=row.ntensors + len(restored))
                records += restored
            except ImportError:
                raise
            except Exception as exc:
                bad.append((restore, str(exc)))
        if row.tier != "restore":  # without its restore unit, a rounded tensor is its rounded value
            records = [r.without_low_bits() for r in records]
        try:
            index.commit_step(row, records, scalars)  # one transaction: nothing of the unit stays if it fails
        except (sqlite3.ProgrammingError, sqlite3.IntegrityError, OverflowError, TypeError, ValueError) as exc:
            # a record the checks let through and SQLite refuses (a value it cannot hold, a name
            # twice): damage of this unit, not a failure of the index (a full disk still fails repair)
            bases.reject()
            bad.append((unit, f"its records cannot be committed: {exc}"))
            if row.tier == "restore":
                bad.append((restore, f"a restore unit whose main unit {unit} cannot be committed"))
            continue
        bases.accept(row, records)
    bad += [(unit, f"a restore unit whose main unit {main} is missing") for main, unit in restores.items()]
    return sorted(bases.rows), bad


def _swap_in(run_dir: str, new_index: str, healthy: bool) -> str | None:
    """Move the old index aside and rename ``new_index`` into place (durably);
    where the old index went. The old main file goes first: until the new one is
    in place the run has no index (writers refuse it), never the old file
    without its ``-wal`` (steps committed in the WAL would look uncommitted)."""
    path = index_path(run_dir)
    aside = None
    if os.path.exists(path) and healthy:
        _fold_wal(path)
        aside = path + PREVIOUS_INDEX_SUFFIX
        for side in _SQLITE_FILES:
            if os.path.lexists(aside + side):
                os.remove(aside + side)
    elif os.path.exists(path):
        aside = f"{path}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
        while any(os.path.lexists(aside + side) for side in _SQLITE_FILES):
            aside += "x"
    for side in _SQLITE_FILES:
        if os.path.lexists(path + side):
            if aside is None:
                os.remove(path + side)  # the WAL files of a lost index: it must not replay into the new one
            else:
                os.rename(path + side, aside + side)
    rename_into_place(new_index, path)
    os.rmdir(os.path.dirname(new_index))
    return aside


def _fold_wal(path: str) -> None:
    """Turn a healthy index into one file (its WAL written into the main file,
    no ``-wal`` or ``-shm``) so that the copy kept of it travels alone. While a
    reader has it open this cannot be done: then its files move as they are."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=0)
        try:
            conn.execute("PRAGMA journal_mode=DELETE")
        finally:
            conn.close()
    except sqlite3.Error:
        pass


# --- reading one unit -----------------------------------------------------------------------

def _backends_by_suffix() -> tuple[dict[str, str], list[ImportError]]:
    """Suffix of a step's file -> backend name, from the backend registry; and the
    errors of the backends whose packages cannot be imported."""
    by_suffix: dict[str, str] = {}
    missing: list[ImportError] = []
    for name in backend_names():
        try:
            by_suffix.setdefault(get_backend(name).suffix, name)
        except ImportError as exc:
            missing.append(exc)
    return by_suffix, missing


def _backend_of(run_dir: str, unit: str, backends, strict: bool = True) -> str | None:
    """The backend that wrote ``unit``: by its suffix (``<step><suffix>``) or, for a
    step of several ranks (``<step>.ranks/``), by the suffix of rank 0's file in it.
    Raises (or, not ``strict``, returns None) when no backend matches."""
    by_suffix, missing = backends
    stem, suffix = os.path.splitext(unit)
    if suffix == RANKS_SUFFIX:
        folder = os.path.join(steps_dir(run_dir), unit)
        for suffix, name in by_suffix.items():
            if os.path.exists(os.path.join(folder, rank_file(0, suffix))):
                return name
        expected = f"rank 0's {' or '.join(rank_file(0, s) for s in by_suffix)} in it"
    elif suffix in by_suffix:
        return by_suffix[suffix]
    else:
        expected = f"<step>{'|'.join([*by_suffix, RANKS_SUFFIX])}"
    if not strict:
        return None
    if missing:
        raise missing[0]  # perhaps the backend of this unit: repairing without it would set it aside
    raise ValueError(f"not a step unit (expected {expected})")


def _read_unit(run_dir: str, unit: str, backends, old_times: dict[int, float], verify: bool,
               bases: _AcceptedUnits) -> tuple[StepRow, list[TensorRecord], dict, str | None]:
    """The index row, records and scalars of a step's main unit, from its manifest, and
    the checksum of its restore unit's manifest (None: the step has one unit); raises
    if damaged. A main unit that names a restore unit is a trajectory point until
    its restore unit is found intact."""
    _check_inside_steps(run_dir, unit)
    step = step_of_unit(unit)
    if step is None:
        raise ValueError("not a step unit (its name is not <step> and a suffix)")
    if step > MAX_STEP:
        raise ValueError(f"step {step} does not fit the index (SQLite holds steps up to 2**63-1)")
    backend = _backend_of(run_dir, unit, backends)
    reader = get_backend(backend).open_step(steps_dir(run_dir), unit)
    try:
        raw = reader.manifest()
        doc = json.loads(raw)
        manifest_version(doc)
        if doc["step"] != step:
            raise CorruptionError(f"its manifest is of step {doc['step']}, its name says {step}")
        if doc.get("unit") == "restore":
            raise ValueError("its manifest is a restore unit's, but it is named as a main unit")
        restore_checksum = _restore_checksum(doc)
        records = [TensorRecord.from_json(r) for r in doc["tensors"]]
        scalars = _scalars(doc)
        row = StepRow(
            step=step, time=old_times.get(step, _mtime(run_dir, unit)), backend=backend,
            location=unit, nbytes=sum(r.nbytes for r in records), ntensors=len(records),
            tier="full" if restore_checksum is None else "trajectory", manifest_checksum=checksum_bytes(raw),
        )
        bases.check(step, records)
        if verify:
            data = StepData(run_dir, row, reader, bases=bases, plain_reads=True)
            for name in data.records:
                data.read(name)  # raises CorruptionError naming the tensor
        return row, records, scalars, restore_checksum
    finally:
        reader.close()


def _scalars(doc: dict) -> dict[str, int | float]:
    """The scalars among the values of a main unit's manifest (a commit records the same)."""
    values = doc.get("values")
    if not (isinstance(values, dict) and isinstance(values.get("items"), dict)):
        raise ValueError("its values are not {'items': {...}, 'objects': {...}}")
    return scalars_of(as_current(values["items"], manifest_version(doc)))


def _restore_checksum(doc: dict) -> str | None:
    """The checksum of the restore unit's manifest that a main unit's manifest records, if any."""
    if "restore_unit" not in doc:
        return None
    named = doc["restore_unit"]
    if not isinstance(named, dict) or not isinstance(named.get("manifest_checksum"), str):
        raise ValueError(f"its manifest names its restore unit as {str(named)[:80]!r}, "
                         "not {'manifest_checksum': ...}")
    return named["manifest_checksum"]


def _read_restore_unit(run_dir: str, row: StepRow, unit: str, checksum: str, verify: bool,
                       bases: _AcceptedUnits) -> list[TensorRecord]:
    """The records (``part`` 'restore') of the restore unit ``unit`` of main unit ``row``;
    raises if it is not the one the main unit records, or is damaged."""
    _check_inside_steps(run_dir, unit)
    reader = get_backend(row.backend).open_step(steps_dir(run_dir), unit)
    try:
        if checksum_bytes(reader.manifest()) != checksum:
            raise CorruptionError(f"its manifest does not match the checksum its main unit {row.location} "
                                  "records (it is not the restore unit written with it, or it is damaged)")
    finally:
        reader.close()
    with _open_step(run_dir, replace(row, tier="restore"), bases) as data:
        records = [r for r in data.records.values() if r.part == "restore"]
        bases.check(row.step, records)
        if verify:
            for rec in records + [r for r in data.records.values() if r.has_low_bits]:
                data.read(rec.name)  # raises CorruptionError naming the tensor (a rounded one: its exact value)
        return records


def _open_step(run_dir: str, row: StepRow, bases: _AcceptedUnits) -> StepData:
    """The data of ``row``, both units of a restore point; closing it closes their readers."""
    backend = get_backend(row.backend)
    readers = [backend.open_step(steps_dir(run_dir), row.location)]
    try:
        if row.tier == "restore":
            readers.append(backend.open_step(steps_dir(run_dir), restore_unit(row.location)))
        return StepData(run_dir, row, *readers, bases=bases, plain_reads=True)
    except BaseException:
        for reader in readers:
            reader.close()
        raise


class _AcceptedUnits:
    """The steps this repair has accepted so far, and the delta bases they serve
    (a :class:`StepData`'s ``bases``): the newest decoded values of each tensor are
    kept, as :class:`.store.Store` keeps them; an older base is read from its unit.
    Values decoded while a unit is checked count once the unit is accepted."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.rows: dict[int, StepRow] = {}
        self._decoded: dict[str, dict[int, np.ndarray]] = {}  # name -> {step: stored bytes}, newest last
        self._pending: dict[str, tuple[int, np.ndarray]] = {}  # of the unit being checked

    def check(self, step: int, records: list[TensorRecord]) -> None:
        """Raise unless every delta among ``records`` (of ``step``) has its base accepted."""
        for rec in records:
            for base in rec.base_steps:
                if base >= step or base not in self.rows:
                    raise CorruptionError(f"tensor {rec.name!r} is a delta against step {base}, which has no "
                                          "intact unit before it (it is missing or damaged): it cannot be decoded")

    def base(self, step: int, name: str, needed_by: int | None = None, pinned: dict | None = None,
             keep=()) -> np.ndarray:
        """The stored bytes of tensor ``name`` at ``step``, from a unit accepted by this
        repair (``needed_by``, the delta's step, is not needed: no writer runs meanwhile;
        nor are ``pinned`` and ``keep``: units are checked in step order, so a delta's
        bases are the values kept last)."""
        row = self.rows.get(step)
        if row is None:
            raise CorruptionError(f"a delta of tensor {name!r} is against step {step}, which has no intact unit")
        cached = self._decoded.get(name, {}).get(step)
        if cached is not None:
            return cached
        with _open_step(self.run_dir, row, self) as data:
            if name not in data.records:
                raise CorruptionError(f"a delta of tensor {name!r} is against step {step}, which has no such tensor")
            value = data.stored(data.records[name])
        self.remember(row, name, value)
        return value

    def remember(self, row: StepRow, name: str, value: np.ndarray) -> None:
        if self.rows.get(row.step) is row:
            self._keep(name, row.step, value)
        else:
            self._pending[name] = (row.step, value)

    def _keep(self, name: str, step: int, value: np.ndarray) -> None:
        values = self._decoded.setdefault(name, {})
        values.pop(step, None)
        values[step] = value
        while len(values) > DECODED_PER_TENSOR:
            del values[next(iter(values))]

    def accept(self, row: StepRow, records: list[TensorRecord]) -> None:
        """``row`` is committed with ``records``: their values decoded meanwhile count."""
        self.rows[row.step] = row
        for rec in records:
            pending = self._pending.get(rec.name)
            if pending is not None and pending[0] == row.step:
                self._keep(rec.name, *pending)
        self._pending.clear()

    def reject(self) -> None:
        """The unit being checked is not committed: forget what it decoded."""
        self._pending.clear()


def _check_inside_steps(run_dir: str, unit: str) -> None:
    """Refuse a symbolic link, as every reader does (:func:`.layout.entry_path`):
    the run's data lies inside it."""
    path = os.path.join(steps_dir(run_dir), unit)
    if os.path.islink(path):
        raise ValueError(f"a symbolic link to {os.readlink(path)}: not followed (step data must lie inside the run)")


def _mtime(run_dir: str, unit: str) -> float:
    """The unit's modification time as its commit time; 0 where the clock that set it
    was before 1970 or beyond what an index row holds (the index would be refused)."""
    t = os.path.getmtime(os.path.join(steps_dir(run_dir), unit))
    return t if 0 <= t < MAX_TIME else 0.0


def _set_aside(run_dir: str, unit: str, why: str, report: RepairReport) -> None:
    """Move a unit that cannot be committed to ``RUN/damaged/`` (kept, not deleted;
    a symbolic link is moved, not its target)."""
    folder = os.path.join(run_dir, DAMAGED_DIR)
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(folder, unit)
    while os.path.lexists(target):
        target += "x"
    os.rename(os.path.join(steps_dir(run_dir), unit), target)
    fsync_dir(folder)
    fsync_dir(steps_dir(run_dir))
    report.set_aside[unit] = why
