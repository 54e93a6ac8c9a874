"""Read access to a run: its index, its steps opened (:class:`.step_data.StepData`), and
the bases of deltas, decoded once and kept for the steps read next.

The run's layout is in :mod:`.layout`; every step's data is found through
:func:`.index.unit_path`, which refuses a location outside ``steps/``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np

from . import predictors
from .backends import StepReader, get_backend
from .errors import CorruptionError, StepNotFoundError
from .index import StepRow, open_existing, unit_path
from .items import TensorRecord
from .layout import asked_step, restore_unit, run_path, steps_dir
from .step_data import StepData, encoded_as

DECODED_PER_TENSOR = 3  # a delta needs its two bases; a third keeps a forward scan from re-reading
OPEN_BASES = 20  # steps kept open for decoding chains
DECODED_BYTES = 1 << 30  # decoded values kept for the deltas read next, in all
REOPENS = 5  # a step rewritten this many times while one reader opens it: that reader gives up


class Store:
    """A run opened for reading (safe while a writer appends); ``plain_reads``: as
    :class:`StepData` takes it, for every step opened."""

    def __init__(self, run_dir: str, plain_reads: bool = False):
        self.run_dir = run_path(run_dir)
        self.plain_reads = plain_reads
        self.index = open_existing(self.run_dir)
        # the newest decoded values of each tensor: reading step after step decodes each delta once
        self._decoded: OrderedDict[tuple, np.ndarray] = OrderedDict()  # (name, (step, time)) -> bytes
        self._decoded_bytes = 0
        self._decoded_of: dict[str, list[tuple]] = {}  # tensor name -> its keys in _decoded
        self._decoded_lock = threading.Lock()  # dask reads steps from several threads
        self._base_steps: OrderedDict[tuple, StepData] = OrderedDict()
        self._bases_lock = threading.RLock()  # a base's own bases are read inside

    def steps(self) -> list[int]:
        return self.index.steps()

    def row(self, step: int) -> StepRow:
        step = asked_step(step)
        row = self.index.step_row(step)
        if row is None:
            steps = self.index.steps()
            have = f"committed steps: {steps[0]}..{steps[-1]} ({len(steps)})" if steps else "no committed steps"
            raise StepNotFoundError(f"step {step} is not committed in {self.run_dir} ({have})")
        return row

    def latest(self) -> int:
        latest = self.index.latest()
        if latest is None:
            raise StepNotFoundError(f"{self.run_dir} has no committed steps")
        return latest

    def restore_points(self) -> list[int]:
        return [r.step for r in self.index.restore_rows()]

    def latest_restore_point(self) -> int:
        points = self.restore_points()
        if not points:
            if not self.index.steps():
                raise StepNotFoundError(f"{self.run_dir} has no committed steps")
            raise StepNotFoundError(f"{self.run_dir} has no restore point: its steps are all trajectory points")
        return points[-1]

    def nearest_restore_points(self, step: int) -> str:
        """Which restore points lie nearest ``step``, said in words."""
        points = self.restore_points()
        before = [p for p in points if p < step][-1:]
        after = [p for p in points if p > step][:1]
        if not points:
            return "The run has no restore point"
        return "The nearest restore point" + ("s: " if len(before + after) > 1 else ": ") + \
            " and ".join(str(p) for p in before + after)

    def not_a_restore_point(self, row: StepRow) -> str:
        """Why trajectory point ``row`` cannot be restored, and where to go instead."""
        return (f"step {row.step} of {self.run_dir} is a trajectory point, not a restore point: it keeps "
                f"{row.ntensors} tensor(s) to read, not the whole state. {self.nearest_restore_points(row.step)}")

    def records(self, step: int) -> list[TensorRecord]:
        step = asked_step(step)
        records = self.index.records(step)
        if not records:  # the step is not committed, or was pruned: its rows go in one transaction
            self.row(step)
        return records

    def open_step(self, step: int, against_index: bool = True, main_only: bool = False) -> StepData:
        """The data of a committed step. ``against_index``: refuse it unless its
        manifest records the same tensors as its index rows (``verify`` compares
        them itself, to report every difference). ``main_only``: a restore point's
        main unit alone (without ``against_index``)."""
        row = self.row(step)
        step = row.step
        for _ in range(REOPENS):
            try:
                return self._open(row, against_index, main_only)
            except Exception as exc:
                # A writer may have pruned the step (or truncated and rewritten it)
                # between reading its row and opening its data: that is no damage.
                now = self.index.step_row(step)
                if now is None:
                    raise StepNotFoundError(
                        f"step {step} was removed from {self.run_dir} while it was being opened"
                    ) from exc
                if now == row:
                    raise
                row, changed = now, exc
        raise StepNotFoundError(f"step {step} of {self.run_dir} was written again {REOPENS} times while it was "
                                "being opened (a writer truncates and rewrites it): read it again") from changed

    def _open(self, row: StepRow, against_index: bool, main_only: bool = False) -> StepData:
        unit_path(self.run_dir, row)  # refuses a location outside steps/ before anything is read
        reader = self._open_unit(row, row.location)
        restore_reader = None
        try:
            if row.tier == "restore" and not main_only:
                restore_reader = self._open_unit(row, restore_unit(row.location))
            data = StepData(self.run_dir, row, reader, restore_reader, self, self.plain_reads)
            if against_index:
                self._check_records(data)
            return data
        except BaseException:
            for r in (reader, restore_reader):
                if r is not None:
                    r.close()
            raise

    def _open_unit(self, row: StepRow, location: str) -> StepReader:
        step = row.step
        try:
            return get_backend(row.backend).open_step(steps_dir(self.run_dir), location)
        except FileNotFoundError as exc:
            raise CorruptionError(f"step {step} is committed in {self.run_dir} but its data is missing: {exc}") from exc
        except Exception as exc:  # damaged files fail in whatever way their library chooses
            raise CorruptionError(f"the data of step {step} in {self.run_dir} is damaged: {exc}") from exc

    def base(self, step: int, name: str, needed_by: int | None = None, pinned: dict | None = None,
             keep=()) -> np.ndarray:
        """The stored bytes of tensor ``name`` at ``step`` (a base of a delta at step
        ``needed_by``), decoded once.

        The values it needs are found first (:meth:`_walk`), down every delta's bases to
        keys or values remembered; then they are decoded in order, each against the values
        just decoded, which are held (in ``pinned``: ``(step, name) -> value``) until the
        last value needing them is decoded, or for good if in ``keep``. So each value is
        decoded once, whatever :data:`DECODED_BYTES` lets :meth:`remember` keep, and
        there is no recursion however long the chain. The steps opened for bases (their
        main units: deltas are only ever taken of a main unit's tensors) stay open, the
        newest :data:`OPEN_BASES`, until :meth:`close`. Raises :class:`StepNotFoundError`
        when step ``needed_by`` was removed meanwhile (with its bases),
        :class:`CorruptionError` when a base cannot be read."""
        pinned = {} if pinned is None else pinned
        want, keep = (step, name), set(keep)
        try:
            with self._bases_lock:  # one chain at a time: the open steps' readers are not shared
                needs = self._walk([want], pinned)
                last_use = {dep: key for key in needs for dep in needs[key]}  # in decoding order
                for key, deps in needs.items():
                    data, rec, _ = self._base_record(*key)
                    pinned[key] = data.stored(rec, bases={dep: pinned[dep] for dep in deps})
                    self.remember(data.row, key[1], pinned[key])  # a raw base too
                    for dep in deps:
                        if last_use[dep] == key and dep != want and dep not in keep:
                            pinned.pop(dep, None)
                return pinned[want]
        except CorruptionError:
            if needed_by is not None and self.index.step_row(needed_by) is None:
                raise StepNotFoundError(f"step {needed_by} was removed from {self.run_dir} while it "
                                        "was being read") from None
            raise

    def _walk(self, wanted: list[tuple[int, str]], held: dict) -> dict[tuple[int, str], list[tuple[int, str]]]:
        """The values to decode for ``wanted`` (``(step, name)``), each with the values it is
        decoded against, in an order that decodes every value after those: lowest step
        first, a predicted delta after the tensors it reads at its step. Values found
        remembered go to ``held`` (which holds them while they are needed) and end the walk
        down there. Raises CorruptionError for a dependency a writer never makes (not
        earlier, or of the same step but not the first tensor of a predicted delta)."""
        needs: dict[tuple[int, str], list[tuple[int, str]]] = {}
        rank: dict[tuple[int, str], int] = {}  # the tensors a prediction reads at a step come first
        todo = list(wanted)
        while todo:
            key = todo.pop()
            if key in needs or key in held:
                continue
            data, rec, cached = self._base_record(*key)
            if cached is not None:
                held[key] = cached  # held: remember() may let it go meanwhile
                continue
            deps = rec.dependencies(key[0])
            for dep in deps:
                read_now = rec.predictor is not None and dep[1] in predictors.same_step(rec.predictor)
                if dep[0] > key[0] or (dep[0] == key[0] and not read_now):
                    raise CorruptionError(f"tensor {key[1]!r} of step {key[0]} in {self.run_dir} is a delta "
                                          f"against step {dep[0]}, which is not earlier: the step's data is damaged")
            rank[key] = data.ranks.get(key[1], 0)
            needs[key] = deps
            todo += deps
        return {key: needs[key] for key in sorted(needs, key=lambda k: (k[0], rank[k], k[1]))}

    def warm_bases(self, wanted: list[tuple[int, str]]) -> dict[tuple[int, str], np.ndarray]:
        """Decode the bases ``(step, name)``, and the bases they need in turn, a step at a
        time, lowest first: each step's tensors in one batch (:meth:`StepData.prefetch`)
        instead of a read per tensor and step. Returns the values of ``wanted`` it
        decoded or found remembered. The values it decodes are held until the last step
        that needs them is decoded (and remembered too), so none is decoded twice,
        whatever :data:`DECODED_BYTES` lets :meth:`remember` keep. Best effort: on damage
        it stops, and :meth:`base` then reads tensor by tensor, naming the damage where
        it lies."""
        held: dict[tuple[int, str], np.ndarray] = {}
        wanted = list(dict.fromkeys(wanted))
        try:
            with self._bases_lock:
                needs = self._walk(wanted, held)
                by_step: dict[int, list[str]] = {}  # the values to decode, in order
                last_use: dict[tuple[int, str], int] = {}  # a value -> the last step decoded against it
                for (step, name), deps in needs.items():
                    by_step.setdefault(step, []).append(name)
                    for dep in deps:
                        last_use[dep] = max(last_use.get(dep, step), step)
                keep = set(wanted)
                for step in sorted(by_step):
                    names = list(by_step[step])
                    data = self._base_step(step)
                    data.prefetch(names, bases=held)
                    for name in names:  # what prefetch leaves to read() (blocks, low bits), base() reads
                        value = data._prefetched.pop(name, None)
                        if value is not None:
                            held[step, name] = value.reshape(-1).view(np.uint8)
                            self.remember(data.row, name, held[step, name])
                    for key in [k for k, last in last_use.items() if last == step and k not in keep]:
                        held.pop(key, None)
        except (OSError, LookupError, ValueError, MemoryError):  # CorruptionError, StepNotFoundError
            pass
        return {key: value for key, value in held.items() if key in keep}

    def _base_record(self, step: int, name: str) -> tuple[StepData, TensorRecord | None, np.ndarray | None]:
        """The open main unit of ``step``, the record of ``name`` in it, and its decoded
        value if it is remembered (then the step is not opened: data and record None)."""
        row = self.index.step_row(step)
        if row is None:
            raise CorruptionError(f"a delta of tensor {name!r} in {self.run_dir} is against step {step}, "
                                  "which is not committed: the run is damaged")
        key = (row.step, row.time)  # the same commit (a truncated run may have rewritten the step)
        with self._decoded_lock:
            cached = self._decoded.get((name, key))
        if cached is not None:
            return None, None, cached
        data = self._base_step(step, row)
        rec = data.records.get(name)
        if rec is None:
            raise CorruptionError(f"a delta of tensor {name!r} in {self.run_dir} is against step {step}, "
                                  "which has no such tensor: the run is damaged")
        return data, rec, None

    def _base_step(self, step: int, row: StepRow | None = None) -> StepData:
        """The main unit of committed ``step``, opened for its tensors' values as bases
        (the newest :data:`OPEN_BASES` stay open)."""
        row = row or self.index.step_row(step)
        if row is None:
            raise CorruptionError(f"a delta in {self.run_dir} is against step {step}, which is not committed: "
                                  "the run is damaged")
        key = (row.step, row.time)
        data = self._base_steps.get(key)
        if data is None:
            data = self.open_step(step, against_index=False, main_only=True)
            self._base_steps[key] = data
            while len(self._base_steps) > OPEN_BASES:
                self._base_steps.popitem(last=False)[1].close()
        self._base_steps.move_to_end(key)
        return data

    def remember(self, row: StepRow, name: str, value: np.ndarray) -> None:
        """Keep a decoded (and checked) value: the next step's delta is decoded against it.
        The newest :data:`DECODED_PER_TENSOR` of each tensor, :data:`DECODED_BYTES` in all."""
        with self._decoded_lock:
            key = (name, (row.step, row.time))
            if key in self._decoded:
                self._decoded.move_to_end(key)
                return
            self._decoded[key] = value
            self._decoded_bytes += value.nbytes
            mine = self._decoded_of.setdefault(name, [])  # this tensor's keys, oldest first
            mine.append(key)
            while len(mine) > DECODED_PER_TENSOR:
                self._decoded_bytes -= self._decoded.pop(mine.pop(0)).nbytes
            while self._decoded_bytes > DECODED_BYTES and len(self._decoded) > 1:
                old, value = self._decoded.popitem(last=False)
                self._decoded_bytes -= value.nbytes
                self._decoded_of[old[0]].remove(old)

    def _check_records(self, data: StepData) -> None:
        """The manifest and the index rows must describe the same tensors: a read
        takes dtype and shape from the manifest, a listing from the index. (Compared
        as stored: the manifest's records are checked already.)"""
        indexed = {row[0]: row[1:] for row in self.index.record_keys(data.row.step)}
        for name in sorted(indexed.keys() ^ data.records.keys()):
            where = "the manifest" if name in data.records else "the index"
            raise CorruptionError(f"step {data.row.step} in {self.run_dir}: only {where} lists tensor {name!r}: "
                                  "the index or the step's data is damaged")
        for name, rec in data.records.items():
            if indexed[name][:4] != (rec.dtype, json.dumps(list(rec.shape)), rec.nbytes, rec.checksum):
                raise CorruptionError(
                    f"step {data.row.step} in {self.run_dir}: tensor {name!r} is {rec.dtype} {list(rec.shape)} "
                    f"in the manifest but {indexed[name][0]} {indexed[name][1]} in the index (or their sizes or "
                    "checksums differ): the index or the step's data is damaged")
            # retention and prune keep a delta's bases by the index: it must say what the manifest says
            if indexed[name][4:] != (rec.encoding, rec.base):
                raise CorruptionError(
                    f"step {data.row.step} in {self.run_dir}: tensor {name!r} is stored as {encoded_as(*indexed[name][4:])}"
                    f" by the index but as {encoded_as(rec.encoding, rec.base)} by the manifest: the index or the "
                    "step's data is damaged")

    def close(self) -> None:
        with self._bases_lock:
            for data in self._base_steps.values():
                data.close()
            self._base_steps.clear()
        with self._decoded_lock:  # a closed History (or restore's store) holds no decoded values
            self._decoded.clear()
            self._decoded_of.clear()
            self._decoded_bytes = 0
        self.index.close()
