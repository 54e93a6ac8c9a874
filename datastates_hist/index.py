"""The index: a SQLite file that says which steps exist and what they hold.

A step exists only once its row is committed here, after its data is durable:
one SQLite transaction (WAL journal, ``synchronous=FULL``) is the atomic act
that makes a step visible. Readers in other processes see only committed
steps. Per-tensor statistics let trajectories be read without tensor data.

An index row names its step's unit (``location``). An index may be damaged or
crafted, so a location is used only once :func:`unit_path` has checked it
against the unit names the row's backend (found in the registry) writes.
"""

from __future__ import annotations

import ctypes
import json
import os
import sqlite3
import time
import weakref
from dataclasses import dataclass

from .errors import CorruptionError, FormatError, StoreNotFoundError
from .items import TensorRecord, check_statistics, is_distribution
from .layout import (INDEX_FILE, PARTIAL, RANKS_SUFFIX, entry_path, file_not_run, finished_units, index_path,
                     step_stem, steps_dir)

FORMAT_VERSION = 6

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY,
    time REAL NOT NULL,            -- unix time of the commit
    backend TEXT NOT NULL,
    location TEXT NOT NULL,        -- the step's file or folder, relative to steps/
    nbytes INTEGER NOT NULL,       -- tensor bytes of the step
    ntensors INTEGER NOT NULL,
    tier TEXT NOT NULL DEFAULT 'full',   -- full, restore (two units) or trajectory
    manifest_checksum TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS tensors (
    step INTEGER NOT NULL REFERENCES steps(step) ON DELETE CASCADE,
    name TEXT NOT NULL,
    dtype TEXT NOT NULL,
    shape TEXT NOT NULL,           -- JSON list
    nbytes INTEGER NOT NULL,
    checksum TEXT NOT NULL,        -- xxh3-64 of the stored bytes, hex
    encoding TEXT NOT NULL DEFAULT 'raw',  -- raw, key or delta (codecs.py)
    norm REAL, min REAL, max REAL, mean REAL, std REAL, nonfinite INTEGER,
    part TEXT NOT NULL DEFAULT '',   -- '' the step's main unit, 'restore' its restore unit
    stored INTEGER,                  -- bytes stored, when encoded
    base INTEGER,                    -- the step a delta is encoded against
    update_ratio REAL,               -- ||x - base|| / ||base|| of a delta of floats
    distribution TEXT,               -- JSON: a tensor of floats' values by sign and exponent
    keep_bits INTEGER,               -- mantissa bits kept by a rounded tensor; NULL: exact
    bound REAL,                      -- a rounded tensor's relative error bound, 2**-(keep_bits+1)
    exact_checksum TEXT,             -- xxh3-64 of a rounded tensor's exact bytes (restore points)
    low_stored INTEGER,              -- bytes of its low bits, in the restore unit (restore points)
    PRIMARY KEY (step, name)
);
CREATE TABLE IF NOT EXISTS scalars (
    step INTEGER NOT NULL REFERENCES steps(step) ON DELETE CASCADE,
    name TEXT NOT NULL,            -- extra/data/loss, optim/param_groups/0/lr (scalars.py)
    value,                         -- INTEGER or REAL as written; NULL for NaN (SQLite has no NaN)
    PRIMARY KEY (step, name)
);
"""

# The first step from which every committed step has its scalars in the ``scalars``
# table (set by the first commit that records them); older steps may lack them.
SCALARS_FROM = "scalars_from_step"

_COLUMNS = {
    "meta": ("key", "value"),
    "steps": ("step", "time", "backend", "location", "nbytes", "ntensors", "tier", "manifest_checksum"),
    "tensors": ("step", "name", "dtype", "shape", "nbytes", "checksum", "encoding",
                "norm", "min", "max", "mean", "std", "nonfinite"),
}

# Tables an index written by an earlier version lacks: checked when present.
_GROWN_COLUMNS = {"scalars": ("step", "name", "value")}

# Columns of ``tensors`` added since version 1 (an index written before lacks some: a writer
# adds them, a reader reads their defaults), with what a row without them means.
_TENSOR_V2 = (("part", "TEXT NOT NULL DEFAULT ''", "''"), ("stored", "INTEGER", "NULL"),
              ("base", "INTEGER", "NULL"), ("update_ratio", "REAL", "NULL"), ("distribution", "TEXT", "NULL"),
              # version 3: tensors rounded to keep_bits (NULL: exact)
              ("keep_bits", "INTEGER", "NULL"), ("bound", "REAL", "NULL"), ("exact_checksum", "TEXT", "NULL"),
              ("low_stored", "INTEGER", "NULL"))

# the tiers of a step's row (full: one unit; restore: a restore point of two units) and the
# latest commit time taken for sound (year 6325): a larger one is damage, not a time
TIERS = ("full", "restore", "trajectory")
MAX_TIME = 2.0 ** 37

STAT_KEYS = ("norm", "min", "max", "mean", "std", "nonfinite")
# the per-step statistics of a tensor in the index: its summary, and a delta's update ratio
TENSOR_STATS = (*STAT_KEYS, "update_ratio")


@dataclass
class StepRow:
    step: int
    time: float
    backend: str
    location: str
    nbytes: int
    ntensors: int
    tier: str
    manifest_checksum: str


def _connect(path: str, readonly: bool) -> sqlite3.Connection:
    if readonly:
        # On a read-only file system SQLite cannot create the WAL's -shm file; a
        # closed run there has no -wal and nobody can change it, so open it immutable.
        frozen = not os.access(os.path.dirname(path) or ".", os.W_OK) and not os.path.exists(path + "-wal")
        uri = f"file:{path}?mode=ro" + ("&immutable=1" if frozen else "")
        conn = sqlite3.connect(uri, uri=True, timeout=30, check_same_thread=False)
    else:
        conn = sqlite3.connect(path, timeout=30, check_same_thread=False)
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


def _make_durable(conn: sqlite3.Connection) -> None:
    """The writer's settings (set after the index was found usable: they write to it)."""
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")


# SQLite errors that say the index could not be opened, not that it is damaged.
_NOT_DAMAGE = ("SQLITE_CANTOPEN", "SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_READONLY", "SQLITE_PERM",
               "SQLITE_AUTH", "SQLITE_FULL", "SQLITE_NOMEM", "SQLITE_IOERR")


class Index:
    """One connection to a run's index (use one per thread)."""

    def __init__(self, run_dir: str, create: bool = False, backend: str | None = None):
        self.path, self.run_dir = index_path(run_dir), run_dir
        self.conn = None
        self.inherited = False  # by a child made by fork: never closed there
        _OPEN.add(self)
        try:
            existed = os.path.exists(self.path)
            if not existed and not create:
                raise StoreNotFoundError(f"{run_dir} is not a datastates-hist run (no {INDEX_FILE})")
            self.conn = _connect(self.path, readonly=not create)
            empty = not self.conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchone()
            if empty and existed:
                self._check_may_be_created(create)
            if create:
                _make_durable(self.conn)
            if empty:
                self._create_schema(backend)
            self._check_format(run_dir)
            if create and not empty:
                self._grow_schema()
            self._tensor_columns = {r[1] for r in self.conn.execute("PRAGMA table_info(tensors)")}
            self._v2_columns = ", ".join(c if c in self._tensor_columns else default
                                         for c, _, default in _TENSOR_V2)
        except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:  # a damaged schema's text too
            self.close()
            raise self._error(exc) from exc
        except BaseException:
            self.close()
            raise

    def _error(self, exc: sqlite3.DatabaseError | UnicodeDecodeError) -> Exception:
        if getattr(exc, "sqlite_errorname", "").startswith(_NOT_DAMAGE):
            return FormatError(f"the index of {self.run_dir} cannot be read: {exc}")
        # SQLite quoting damaged text in its own error gives an error the sqlite3 module cannot decode
        what = "a text in it is not UTF-8" if isinstance(exc, UnicodeDecodeError) else exc
        return CorruptionError(f"the index {self.path} is damaged ({what}); rebuild it from the step "
                               f"data with: datastates-hist repair {self.run_dir}")

    def _check_may_be_created(self, writer: bool) -> None:
        """An index without tables (zero-length, say) is being created, or was left
        so by a writer that stopped while creating it, only while no step data lies
        beside it (a writer creates the index before any step): then the writer,
        which holds the run's lock, creates it. Beside step data it was lost."""
        units = finished_units(self.run_dir)
        if units:
            raise CorruptionError(
                f"the index {self.path} is damaged (it holds no tables) while {steps_dir(self.run_dir)} "
                f"holds {len(units)} step unit(s): it was lost; rebuild it from the step data with: "
                f"datastates-hist repair {self.run_dir}"
            )
        if not writer:
            raise StoreNotFoundError(
                f"{self.run_dir} has an empty index ({INDEX_FILE} has no tables) and no step data: a writer "
                "is creating it, or stopped before it did (the next writer creates it)"
            )

    def _create_schema(self, backend: str | None) -> None:
        with self.conn:  # one transaction: readers never see half a schema
            self.conn.executescript("BEGIN;" + SCHEMA)
            self.conn.executemany(
                "INSERT OR IGNORE INTO meta VALUES (?, ?)",
                [("format_version", str(FORMAT_VERSION)), ("backend", backend or ""),
                 ("created", str(time.time()))],
            )

    def _grow_schema(self) -> None:
        """Add the tables of this version that an index written before lacks (a writer
        appending to an older run); its rows are not rewritten."""
        with self.conn:
            self.conn.executescript("BEGIN;" + SCHEMA)
            found = {r[1] for r in self.conn.execute("PRAGMA table_info(tensors)")}
            for column, declaration, _ in _TENSOR_V2:
                if column not in found:
                    self.conn.execute(f"ALTER TABLE tensors ADD COLUMN {column} {declaration}")
            self.conn.execute("UPDATE meta SET value=? WHERE key='format_version' AND CAST(value AS INTEGER) < ?",
                              (str(FORMAT_VERSION), FORMAT_VERSION))

    def _check_format(self, run_dir: str) -> None:
        # quick_check walks every page once (about 0.1 s for 1000 steps of 300
        # tensors), so a damaged index is named here rather than by a later query.
        found = [r[0] for r in self.conn.execute("PRAGMA quick_check")]
        if found != ["ok"]:
            raise sqlite3.DatabaseError("; ".join(found[:3]))
        self._check_schema()
        row = self.conn.execute("SELECT value FROM meta WHERE key='format_version'").fetchone()
        try:
            version = int(row[0]) if row else 0
        except (TypeError, ValueError):
            raise sqlite3.DatabaseError(f"its format version is {row[0]!r}, not a number") from None
        if version > FORMAT_VERSION:
            raise FormatError(
                f"{run_dir} was written in format version {version}; this datastates-hist "
                f"reads up to version {FORMAT_VERSION}: upgrade datastates-hist"
            )

    def _check_schema(self) -> None:
        """The tables and columns this version reads: an index missing one is damaged
        (a query would otherwise fail later with SQLite's own message)."""
        for table, columns in {**_COLUMNS, **_GROWN_COLUMNS}.items():
            found = tuple(r[1] for r in self.conn.execute(f"PRAGMA table_info({table})"))
            if table in _GROWN_COLUMNS and not found:
                continue
            if found[:len(columns)] != columns:
                what = "is missing" if not found else f"has the columns {list(found)}"
                raise sqlite3.DatabaseError(f"its table {table!r} {what}")

    def backend(self, asked: str | None = None) -> str:
        """The backend of the run: ``asked`` if given, else the one the index names
        (``adios2`` for a new run); an unknown stored name is a :class:`FormatError`."""
        from .backends import backend_names  # here: the registry loads numpy, which a listing does not need

        name = asked or self.meta("backend") or "adios2"
        if not asked and name not in backend_names():
            raise FormatError(
                f"{os.path.dirname(self.path)} was written with the backend {name!r}, which this "
                f"installation does not have (available: {', '.join(backend_names())})"
            )
        return name

    def meta(self, key: str) -> str | None:
        rows = self._read("SELECT value FROM meta WHERE key=?", (key,))
        return rows[0][0] if rows else None

    def commit_step(self, row: StepRow, records: list[TensorRecord],
                    scalars: dict[str, int | float] | None = None) -> None:
        """Make a step visible: its row, its tensors and (when given) its scalars in one
        transaction. ``scalars`` None: not recorded (the step's manifest holds them)."""
        with self.conn:
            self.conn.execute(
                "INSERT INTO steps VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (row.step, row.time, row.backend, row.location, row.nbytes, row.ntensors,
                 row.tier, row.manifest_checksum),
            )
            self.conn.executemany(
                "INSERT INTO tensors VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(row.step, r.name, r.dtype, json.dumps(list(r.shape)), r.nbytes, r.checksum,
                  r.encoding, *(r.stats.get(k) for k in STAT_KEYS), r.part, r.stored, r.base,
                  r.update_ratio, _json_or_null(r.distribution), r.keep_bits, r.bound, r.exact_checksum,
                  r.low_stored) for r in records],
            )
            if scalars is not None:
                self._insert_scalars(row.step, scalars)

    def _insert_scalars(self, step: int, scalars: dict[str, int | float]) -> None:
        """Inside :meth:`commit_step`'s transaction: the step's scalars, and where recording
        began (the first step after every step committed before, at the first such commit)."""
        self.conn.execute(
            "INSERT OR IGNORE INTO meta SELECT ?, CAST(MAX(COALESCE(MAX(step) + 1, 0), ?) AS TEXT)"
            " FROM steps WHERE step <> ?", (SCALARS_FROM, step, step))
        self.conn.executemany("INSERT INTO scalars VALUES (?, ?, ?)",
                              [(step, name, value) for name, value in scalars.items()])

    def demote_step(self, step: int) -> None:
        """Make restore point ``step`` a trajectory point: one transaction drops the rows
        of its restore unit's tensors (and the low bits of its rounded tensors, with the
        checksum of their exact bytes) and says what is left."""
        with self.conn:
            self.conn.execute("DELETE FROM tensors WHERE step=? AND part='restore'", (step,))
            if "low_stored" in self._tensor_columns:
                # a rounded tensor's low bits go with the restore unit: its rounded value is left
                self.conn.execute("UPDATE tensors SET exact_checksum=NULL, low_stored=NULL"
                                  " WHERE step=? AND low_stored IS NOT NULL", (step,))
            self.conn.execute(
                "UPDATE steps SET tier='trajectory', nbytes=(SELECT COALESCE(SUM(nbytes), 0) FROM tensors"
                " WHERE step=?), ntensors=(SELECT COUNT(*) FROM tensors WHERE step=?) WHERE step=?",
                (step, step, step))

    def tensor_parts(self, step: int) -> list[tuple[str, str, int | None]]:
        """``(name, unit part, keep_bits)`` of each tensor of ``step`` (keep_bits None: exact)."""
        bits = "keep_bits" if "keep_bits" in self._tensor_columns else "NULL"
        return self._read(f"SELECT name, part, {bits} FROM tensors WHERE step=? ORDER BY name", (step,))

    def steps_with_restore_rows(self) -> set[int]:
        """The steps whose restore unit has tensor rows (a demotion drops them)."""
        return {step for (step,) in self.conn.execute("SELECT DISTINCT step FROM tensors WHERE part='restore'")}

    def restore_rows(self) -> list[StepRow]:
        """The rows of the restore points (every step that is not a trajectory point)."""
        return [self._step_row(r) for r in self._read("SELECT * FROM steps WHERE tier <> 'trajectory' ORDER BY step")]

    def delta_bases(self, since: int = 0) -> list[tuple[int, int]]:
        """``(step, base)`` for every step from ``since`` on that holds a delta against ``base``."""
        if "base" not in self._tensor_columns:
            return []
        return self._read("SELECT DISTINCT step, base FROM tensors WHERE step >= ? AND base IS NOT NULL", (since,))

    def stored_bytes(self) -> list[tuple[int, str, str, int, int]]:
        """``(step, group, encoding, nbytes, stored)`` for every step: its tensors' bytes
        summed by group (a name's first part with its ``/``: ``model/``, ``optim/``; ''
        for a name without one) and encoding, as they are and as stored (``stored`` of
        an encoded tensor, else ``nbytes``, as in an index of version 1; with the low bits
        of a rounded tensor of a restore point, stored in its restore unit)."""
        stored = "COALESCE(stored, nbytes)" if "stored" in self._tensor_columns else "nbytes"
        if "low_stored" in self._tensor_columns:
            stored += " + COALESCE(low_stored, 0)"
        return self._read(f"SELECT step, substr(name, 1, instr(name, '/')), encoding, SUM(nbytes), SUM({stored})"
                          " FROM tensors GROUP BY 1, 2, 3 ORDER BY 1, 2, 3")

    def delete_steps(self, steps: list[int]) -> None:
        with self.conn:
            self.conn.executemany("DELETE FROM steps WHERE step=?", [(s,) for s in steps])

    def steps(self) -> list[int]:
        return [r[0] for r in self._read("SELECT step FROM steps ORDER BY step")]

    def step_rows(self) -> list[StepRow]:
        return [self._step_row(r) for r in self._read("SELECT * FROM steps ORDER BY step")]

    def step_row(self, step: int) -> StepRow | None:
        rows = self._read("SELECT * FROM steps WHERE step=?", (step,))
        return self._step_row(rows[0]) if rows else None

    def latest(self) -> int | None:
        return self._read("SELECT MAX(step) FROM steps")[0][0]

    def records(self, step: int) -> list[TensorRecord]:
        rows = self._read(
            "SELECT name, dtype, shape, nbytes, checksum, encoding, norm, min, max, mean, std,"
            f" nonfinite, {self._v2_columns} FROM tensors WHERE step=? ORDER BY rowid", (step,)
        )
        try:
            return [
                TensorRecord.from_json({
                    "name": name, "dtype": dtype, "shape": json.loads(shape), "nbytes": nbytes,
                    "checksum": checksum, "encoding": encoding,
                    "stats": {k: v for k, v in zip(STAT_KEYS, stats) if v is not None},
                    "part": part, "stored": stored, "base": base, "update_ratio": ratio,
                    "distribution": json.loads(distribution) if distribution is not None else None,
                    "keep_bits": keep_bits, "bound": bound, "exact_checksum": exact, "low_stored": low_stored},
                    indexed=True)
                for name, dtype, shape, nbytes, checksum, encoding, *stats, part, stored, base, ratio,
                distribution, keep_bits, bound, exact, low_stored in rows
            ]
        except ValueError as exc:  # a damaged or crafted row: named before its sizes are used
            raise CorruptionError(
                f"the index {self.path} is damaged: step {step}: {exc} (rebuild it from the step data "
                f"with: datastates-hist repair {self.run_dir})"
            ) from None

    def integrity_check(self) -> list[str]:
        """SQLite's full check (``["ok"]`` when intact); slower than the one at open."""
        return [r[0] for r in self._read("PRAGMA integrity_check")]

    def record_keys(self, step: int) -> list[tuple]:
        """``(name, dtype, shape as JSON, nbytes, checksum, encoding, base)`` of the tensors of
        ``step``, as stored (an index of format 1 has neither encoding nor base: raw, None)."""
        encoding = "encoding" if "encoding" in self._tensor_columns else "'raw'"
        base = "base" if "base" in self._tensor_columns else "NULL"
        return self._read(f"SELECT name, dtype, shape, nbytes, checksum, {encoding}, {base} FROM tensors WHERE step=?",
                          (step,))

    def tensor_stats(self, name: str) -> list[tuple]:
        """``(step, time, norm, min, max, mean, std, nonfinite, update_ratio)`` of tensor ``name``
        at every step, each row's statistics checked as :meth:`records` and :meth:`step_row` check theirs
        (a statistic that is text, a time that is none: :class:`CorruptionError`)."""
        ratio = "t.update_ratio" if "update_ratio" in self._tensor_columns else "NULL"
        rows = self._read(
            f"SELECT s.*, t.norm, t.min, t.max, t.mean, t.std, t.nonfinite, {ratio}"
            " FROM tensors t JOIN steps s ON s.step = t.step WHERE t.name=? ORDER BY t.step",
            (name,),
        )
        width = len(StepRow.__dataclass_fields__)
        found = []
        for values in rows:
            step, time, *_ = values
            *stats, nonfinite, update_ratio = values[width:]
            # what a commit writes passes at once (a trace reads thousands of rows); else the full checks
            if not (type(step) is int and type(time) is float and 0 <= time < MAX_TIME):
                self._step_row(values[:width])
            if not _as_committed(stats, nonfinite, update_ratio):
                try:
                    check_statistics(name, {k: v for k, v in zip(STAT_KEYS, (*stats, nonfinite)) if v is not None},
                                     update_ratio)
                except ValueError as exc:  # the check of records(): a damaged or crafted row
                    raise CorruptionError(
                        f"the index {self.path} is damaged: step {step}: {exc} (rebuild it from the step data "
                        f"with: datastates-hist repair {self.run_dir})"
                    ) from None
            found.append(values[:2] + values[width:])
        return found

    def distributions(self, name: str) -> list[tuple[int, dict]]:
        """``(step, distribution)`` of tensor ``name`` at every step that records one
        (:func:`digest.distribution`)."""
        if "distribution" not in self._tensor_columns:
            return []
        rows = self._read("SELECT step, distribution FROM tensors WHERE name=? AND distribution IS NOT NULL"
                          " ORDER BY step", (name,))
        found = []
        for step, text in rows:
            try:
                d = json.loads(text)
            except (TypeError, ValueError):
                d = None
            if not is_distribution(d):
                raise CorruptionError(
                    f"the index {self.path} is damaged: step {step}: tensor {name!r} has a malformed "
                    f"distribution (rebuild it from the step data with: datastates-hist repair {self.run_dir})")
            found.append((step, d))
        return found

    def has_scalars(self) -> bool:
        """Whether the index has the ``scalars`` table (an index written before it has none)."""
        return bool(self._read("SELECT 1 FROM sqlite_master WHERE type='table' AND name='scalars'"))

    def scalars_from(self) -> int | None:
        """The step from which every committed step has its scalars in the index; None
        when no step has them (no commit recorded any)."""
        if not self.has_scalars():
            return None
        value = self.meta(SCALARS_FROM)
        try:
            return int(value) if value is not None else None
        except ValueError:
            raise CorruptionError(f"the index {self.path} is damaged: {SCALARS_FROM} is {value!r}, "
                                  f"not a step (rebuild it with: datastates-hist repair {self.run_dir})") from None

    def scalar_rows(self) -> list[tuple]:
        """``(step, name, value)`` of every scalar recorded, by step (value None: NaN)."""
        if not self.has_scalars():
            return []
        rows = self._read("SELECT step, name, value FROM scalars ORDER BY step, rowid")
        problem = next(filter(None, map(_scalar_row_problem, rows)), None)
        if problem is not None:
            raise CorruptionError(f"the index {self.path} is damaged ({problem}); rebuild it from the step data "
                                  f"with: datastates-hist repair {self.run_dir}")
        return rows

    def scalar_steps(self) -> list[int]:
        """The committed steps with at least one scalar row."""
        if not self.has_scalars():
            return []
        return [r[0] for r in self._read("SELECT DISTINCT step FROM scalars ORDER BY step")]

    def tensor_names(self) -> list[str]:
        return [r[0] for r in self._read("SELECT DISTINCT name FROM tensors ORDER BY name")]

    def _step_row(self, values: tuple) -> StepRow:
        """A row of ``steps`` whose values have the types a commit writes: SQLite keeps
        whatever a damaged or hand-edited index holds (a time of 1e20, a text count)."""
        row = StepRow(*values)
        sound = (type(row.step) is int and type(row.nbytes) is int and row.nbytes >= 0
                 and type(row.ntensors) is int and row.ntensors >= 0
                 and isinstance(row.time, (int, float)) and 0 <= row.time < MAX_TIME
                 and row.tier in TIERS and isinstance(row.backend, str) and isinstance(row.location, str)
                 and isinstance(row.manifest_checksum, str))
        if not sound:
            raise CorruptionError(f"the index {self.path} is damaged (the row of step {row.step!r} holds "
                                  f"{values!r}); rebuild it from the step data with: datastates-hist repair "
                                  f"{self.run_dir}")
        return row

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        """The rows of a query; a page or a text that SQLite cannot read (which
        ``quick_check`` at open does not see) is named as damage of the index."""
        try:
            return self.conn.execute(sql, args).fetchall()
        except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:
            raise self._error(exc) from exc

    def close(self) -> None:
        if self.conn is not None and not self.inherited:
            self.conn.close()
        _OPEN.discard(self)


def _as_committed(stats: list, nonfinite, update_ratio) -> bool:
    """Whether a row's statistics have the types a commit writes (floats or null, a count
    or null): a quick pass for sound rows; :func:`.items.check_statistics` names the rest."""
    return (all(type(v) is float or v is None for v in stats)
            and (nonfinite is None or type(nonfinite) is int and nonfinite >= 0)
            and (update_ratio is None or type(update_ratio) is float))


_OPEN: "weakref.WeakSet[Index]" = weakref.WeakSet()


def _never_closed_in_child() -> None:
    """SQLite connections must not cross a fork, not even to be closed: another thread
    of the parent (the flusher, committing) may have held one of SQLite's mutexes at
    the fork, and the child's close at its exit would wait for it forever. A child
    made by fork (a DataLoader worker) keeps the connections it inherited, untouched,
    until it ends: each gets a reference that is never given back."""
    for index in list(_OPEN):
        index.inherited = True
        if index.conn is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(index.conn))
    _OPEN.clear()


os.register_at_fork(after_in_child=_never_closed_in_child)


def open_existing(run_dir: str) -> "Index":
    """The index of the run at ``run_dir``, opened for reading; a folder that is missing
    is :class:`StoreNotFoundError` ``no run at``, one without an index another."""
    if not os.path.isdir(run_dir):
        why = file_not_run(run_dir)
        raise StoreNotFoundError(f"no run at {run_dir}" + (f": {why}" if why else ""))
    return Index(run_dir)


# one encoder for every row: json.dumps with options builds a new one per call, which cost
# more than the encoding (the small GPT's 309 distributions: 3.2 -> 1.8 ms per step)
_compact = json.JSONEncoder(separators=(",", ":")).encode


def _scalar_row_problem(row: tuple) -> str | None:
    """What no commit writes in a scalar row ``(step, name, value)``, in words; None if nothing."""
    step, name, value = row
    if type(step) is not int:
        return f"a scalar row's step is {step!r}, not a step"
    if type(name) is not str:
        return f"a scalar of step {step} is named {name!r}, not a name"
    if not (type(value) in (int, float) or value is None):
        return f"scalar {name!r} of step {step} is {value!r}, not a number"
    return None


def _json_or_null(value) -> str | None:
    return None if value is None else _compact(value)


# --- the unit an index row names ------------------------------------------------------------

def unit_suffixes(step: int, backend: str) -> tuple[str, ...]:
    """The suffixes the unit of ``step`` written by ``backend`` may have: the
    backend's (one file or folder) or ``.ranks`` (a folder of one file per rank);
    none for a registered backend that declares no suffix of its own."""
    from .backends import get_backend

    try:
        suffix = get_backend(backend).suffix
    except ValueError as exc:  # an unknown backend name: the row is not one a writer made
        raise CorruptionError(f"step {step} names an unknown backend: {exc}") from None
    return (suffix, RANKS_SUFFIX) if suffix else ()


def unit_path(run_dir: str, row: StepRow) -> str:
    """The path of the unit of the committed step ``row`` (an index row).

    Refused with :class:`CorruptionError` unless the location is the step's own
    unit name (:func:`check_location`) and the entry in ``steps/`` is not a
    symbolic link: both together keep the path inside ``steps/``. A unit that
    is missing is not refused here: reading it reports it missing, pruning has
    nothing to delete.
    """
    return entry_path(steps_dir(run_dir), check_location(run_dir, row), f"the data of step {row.step} in {run_dir}")


def check_location(run_dir: str, row: StepRow) -> str:
    """The location of index row ``row``, once it is the step's own unit name:
    the step's zero-padded number and one of its suffixes (any plain suffix for
    a backend that declares none). So one plain name (no ``/``, no ``..``, not
    absolute), and not the unit of another step. Raises :class:`CorruptionError`
    otherwise."""
    stem, suffixes = step_stem(row.step), unit_suffixes(row.step, row.backend)
    location = row.location
    rest = location[len(stem):] if isinstance(location, str) and location.startswith(stem) else None
    if rest is None or not (rest in suffixes if suffixes else _plain_suffix(rest)):
        must = (" or ".join(repr(stem + s) for s in suffixes) if suffixes
                else f"'{stem}' and the suffix of backend {row.backend!r}")
        raise CorruptionError(
            f"the index row of step {row.step} in {run_dir} names {location!r} as the step's data, "
            f"which must be {must} in {steps_dir(run_dir)}: the index is damaged "
            f"(rebuild it with: datastates-hist repair {run_dir})"
        )
    return location


def _plain_suffix(rest: str) -> bool:
    return rest == "" or (rest.startswith(".") and "/" not in rest and "\0" not in rest
                          and not rest.endswith(PARTIAL))
