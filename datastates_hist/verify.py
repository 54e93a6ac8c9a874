"""Verify a run: re-read every tensor of its committed steps and check it.

For each step, :func:`verify_run` opens the step's data (which checks the
manifest against the index, and for ADIOS2 the BP5 files against their
recorded sizes and checksums), compares the index's tensor rows with the
manifest, then reads every tensor and recomputes its xxh3-64 checksum. A
restore point's records are those of both its units, a trajectory point's those
of its main unit. An encoded tensor is decoded (a delta against its base, read
through the :class:`Store`) and its checksum is that of the decoded bytes; a
delta whose base cannot be read is reported with the base's step. A tensor
rounded to ``keep_bits`` is checked as its rounded value (its checksum), and in a
restore point also as its exact value, with its low bits from the restore unit
(its exact checksum). It never stops at the first problem: every damaged step
and tensor is reported.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

from .errors import CorruptionError, StepNotFoundError
from .items import TensorRecord
from .step_data import StepData
from .store import Store

Progress = Callable[[int, "str | None", int], None]
"""Called as ``progress(step, tensor, nbytes)`` after each tensor is checked
(``tensor`` is None when a whole step is skipped as damaged)."""


@dataclass
class Problem:
    """One damaged thing: a tensor of a step, or (``tensor`` None) a whole step.

    Attributes:
        step: the committed step.
        tensor: the tensor's item name, or None when the step's data, its
            manifest or its index row is damaged as a whole.
        message: what is wrong.
    """

    step: int
    tensor: str | None
    message: str

    def __str__(self) -> str:
        where = f"step {self.step}" + (f", tensor {self.tensor!r}" if self.tensor else "")
        return f"{where}: {self.message}"

    def to_json(self) -> dict:
        return asdict(self)


def verify_run(run_dir: str, steps: Iterable[int] | None = None,
               progress: Progress | None = None) -> list[Problem]:
    """Check the given committed steps of ``run_dir`` (default: all of them).

    Raises:
        StoreNotFoundError: no run at ``run_dir``.
        CorruptionError: the index is damaged (see ``datastates-hist repair``).
        StepNotFoundError: a step asked for is not committed.

    Returns:
        Every problem found, in step order; empty when the steps are intact.
        Steps pruned by a writer while they were being checked are skipped.
    """
    store = Store(os.fspath(run_dir), plain_reads=True)
    try:
        _check_index(store)
        if steps is None:
            wanted = store.steps()
        else:
            wanted = sorted(set(steps))
            for step in wanted:
                store.row(step)  # a clear error for a step that is not committed
        problems: list[Problem] = []
        for step in wanted:
            problems += verify_step(store, step, progress)
        return problems
    finally:
        store.close()


def _check_index(store: Store) -> None:
    """The full SQLite check (opening runs the quicker one): it also compares
    the index's b-trees with its tables."""
    found = store.index.integrity_check()
    if found != ["ok"]:
        raise CorruptionError(
            f"the index {store.index.path} is damaged ({'; '.join(found[:3])}); rebuild it from the "
            f"step data with: datastates-hist repair {store.run_dir}"
        )


def verify_step(store: Store, step: int, progress: Progress | None = None) -> list[Problem]:
    """The problems of one committed step of an open :class:`Store`."""
    row = store.index.step_row(step)
    if row is None:
        return []  # pruned since the list of steps was read
    try:
        data = store.open_step(step, against_index=False)
    except StepNotFoundError:
        return []
    except Exception as exc:  # a damaged unit may fail in any way its library chooses
        if progress:
            progress(step, None, row.nbytes)
        return [Problem(step, None, f"its data cannot be opened: {exc}")]
    try:
        try:
            problems = _check_manifest(store, data)
        except (sqlite3.DatabaseError, CorruptionError, ValueError, KeyError, TypeError) as exc:
            problems = [Problem(step, None, f"its manifest or index rows cannot be compared: {exc}")]
        for name, rec in data.records.items():
            problems += _check_tensor(store, data, rec)
            if progress:
                progress(step, name, rec.nbytes)
        if problems and store.index.step_row(step) != row:
            return []  # pruned (or truncated and rewritten) by a writer while being checked
        return problems
    finally:
        data.close()


def _check_tensor(store: Store, data: StepData, rec: TensorRecord) -> list[Problem]:
    """The problem of one tensor, if any: a delta whose base cannot be read is
    reported as such (the base's own step reports what is wrong with it)."""
    step = data.row.step
    for base, name in _earlier_values(data, rec):
        try:
            store.base(base, name)  # decoded once: the read below finds it
        except Exception as exc:
            return [Problem(step, rec.name, f"its delta base at step {base} cannot be read: {exc}")]
    try:
        data.read(rec.name)
    except Exception as exc:
        return [Problem(step, rec.name, str(exc))]
    return []


def _earlier_values(data: StepData, rec: TensorRecord) -> list[tuple[int, str]]:
    """The values of earlier steps that decoding ``rec`` reads: its bases, and for a
    predicted delta those its prediction reads, there or through tensors of its step."""
    step, found, todo, seen = data.row.step, [], [rec], {rec.name}
    while todo:
        for base, name in todo.pop().dependencies(step):
            if base < step:
                found.append((base, name))
            elif name not in seen and name in data.records:
                seen.add(name)
                todo.append(data.records[name])
    return list(dict.fromkeys(found))


def _check_manifest(store: Store, data: StepData) -> list[Problem]:
    """The manifest against its index rows: they must say the same."""
    row, step = data.row, data.row.step
    problems = []
    doc = json.loads(data.reader.manifest())
    if doc.get("step") != step:
        problems.append(Problem(step, None, f"its manifest is of step {doc.get('step')}: the index row is damaged"))
    indexed = {r.name: r for r in store.index.records(step)}
    for name, rec in data.records.items():
        have = indexed.pop(name, None)
        if have is None:
            problems.append(Problem(step, name, "the index has no row for this tensor of the manifest"))
        elif not _same_record(have, rec):
            problems.append(Problem(step, name, "its index row does not match the manifest: the index is damaged"))
    problems += [Problem(step, name, "the index has a row for a tensor the manifest does not hold")
                 for name in indexed]
    if row.ntensors != len(data.records) or row.nbytes != sum(r.nbytes for r in data.records.values()):
        problems.append(Problem(step, None, "its index row counts other tensors or bytes than the manifest"))
    return problems


def _same_record(a, b) -> bool:
    # SQLite stores NaN as NULL, which the index reads back as a missing statistic
    same_stats = all(_same_number(a.stats.get(k, math.nan), b.stats.get(k, math.nan))
                     for k in a.stats.keys() | b.stats.keys())
    return ((a.name, a.dtype, tuple(a.shape), a.nbytes, a.checksum, a.encoding, a.part, a.stored, a.base)
            == (b.name, b.dtype, tuple(b.shape), b.nbytes, b.checksum, b.encoding, b.part, b.stored, b.base)
            and same_stats and _same_number(a.update_ratio, b.update_ratio)
            and (a.keep_bits, a.bound, a.exact_checksum, a.low_stored)
            == (b.keep_bits, b.bound, b.exact_checksum, b.low_stored))


def _same_number(x, y) -> bool:
    return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
