"""An open step of a run: its records and plain values, and verified, batched reads
of its tensors, decoded against their bases (which :class:`.store.Store` finds and keeps).

Every unit is found through :func:`.index.unit_path`, which refuses a location outside
``steps/``.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import math
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from . import predictors, values
from .backends import StepReader
from .boxes import overlap
from .cache import aligned
from .digest import checksum_bytes
from .dtypes import dtype_name, storage_dtype, storage_torch_dtype, torch_dtype
from .errors import CorruptionError, FormatError, StepNotFoundError
from .codecs import decode
from .rounding import add_low_bits
from .index import FORMAT_VERSION, StepRow, unit_path
from .items import LOSSY_KEYS, TensorRecord
from .layout import restore_unit, unit_bytes


HUGE_PAGE = 2 << 20


def fresh_arrays(specs: list[tuple[tuple[int, ...], np.dtype]]):
    """Empty arrays of these ``(shape, dtype)``, carved from one anonymous mapping that
    asks for transparent huge pages: the first write of fresh memory, a page fault per
    4 KiB page otherwise, took 3-4x longer than the read itself (docs/performance.md)."""
    sizes = [math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in specs]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += aligned(n)
    if total < HUGE_PAGE:
        yield from (np.empty(shape, dtype) for shape, dtype in specs)
        return
    buf = mmap.mmap(-1, total)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    for (shape, dtype), at in zip(specs, offsets):
        yield np.frombuffer(buf, dtype=dtype, count=math.prod(shape), offset=at).reshape(shape)


# Stored bytes of encoded tensors read at once by a prefetch: the blobs wait for their
# decode in memory, so a restore holds at most this much beside the tensors.
BATCH_BYTES = 256 << 20
# A batch is read (or mapped) and handed to the decoders in waves of about this many stored
# bytes, each wave's decodes split in one task per decoder: the decoders start on the first
# wave while the next is read, and a task per tensor (309 for the small GPT) cost the reading
# thread a future and a wake-up each.
WAVE_BYTES = 4 << 20
# Threads decoding a prefetch's tensors (blosc2, numpy and xxhash release the GIL in them).
DECODERS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def encoded_as(encoding: str, base: int | None) -> str:
    return encoding if base is None else f"{encoding} against step {base}"


class UnreadableBase(CorruptionError):
    """A delta's base cannot be read (the base's own damage says why)."""


def _claim(spans: list[tuple[int, int]], array: np.ndarray) -> bool:
    """Add ``array``'s bytes to ``spans`` (sorted, disjoint ``(start, end)`` addresses) unless
    they overlap one of them; whether they were added."""
    start = array.ctypes.data
    end = start + array.nbytes
    i = bisect.bisect(spans, (start, end))
    if (i and spans[i - 1][1] > start) or (i < len(spans) and spans[i][0] < end):
        return False
    spans.insert(i, (start, end))
    return True


def _runs(records, limit: int):
    """``records`` in consecutive runs of at most ``limit`` stored bytes (a larger record
    alone), none empty."""
    run: list[TensorRecord] = []
    size = 0
    for rec in records:
        if run and size + rec.stored > limit:
            yield run
            run, size = [], 0
        run.append(rec)
        size += rec.stored
    if run:
        yield run


def _shares(jobs: list[tuple], n: int) -> list[list[tuple]]:
    """``jobs`` (decodes: record first) in at most ``n`` consecutive runs of about equal
    stored bytes, none empty."""
    total = sum(job[0].stored for job in jobs)
    shares: list[list[tuple]] = [[]]
    acc = 0
    for job in jobs:
        # a new share once this job lies mostly past the current share's part of the total
        if shares[-1] and len(shares) < n and acc + job[0].stored / 2 >= total * len(shares) / n:
            shares.append([])
        shares[-1].append(job)
        acc += job[0].stored
    return shares if jobs else []


def manifest_version(doc: dict, subject: str = "") -> int:
    """The format version step manifest ``doc`` was written in (1 where it names none).

    Raises:
        FormatError: a version newer than this reader's, its message led by ``subject``.
    """
    version = int(doc.get("format_version", 1))
    if version > FORMAT_VERSION:
        raise FormatError(f"{subject}written in format version {version}; this datastates-hist reads up to "
                          f"version {FORMAT_VERSION}: upgrade datastates-hist")
    return version


class StepData:
    """An open step: its records and plain values, and verified tensor reads.

    ``restore_reader``: the reader of a restore point's restore unit. ``bases``:
    where a delta's base is read (``bases.base(step, name, needed_by, pinned, keep)`` -> its
    stored bytes; ``needed_by``: the step of the delta) and decoded values are remembered
    (``bases.remember(row, name, bytes)``): the :class:`.store.Store` that opened the step.
    ``plain_reads``: every tensor read with the reader's plain ``read``, never in a batch,
    mapped or by a table of locations (verify and repair: what they accept reads back by
    every path, a dataset's damaged header included)."""

    def __init__(self, run_dir: str, row: StepRow, reader: StepReader,
                 restore_reader: StepReader | None = None, bases=None, plain_reads: bool = False):
        self.run_dir, self.row, self.reader = run_dir, row, reader
        self.plain_reads = plain_reads
        self.readers = {"": reader, "restore": restore_reader}
        self._bases = bases
        raw = self._manifest(reader, row.manifest_checksum, "")
        try:
            doc = json.loads(raw)
            self.records = {r.name: r for r in map(TensorRecord.from_json, doc["tensors"])}
            if restore_reader is not None:
                self._add_restore_unit(restore_reader, doc)
            else:  # a trajectory point (or a main unit read alone): rounded tensors as rounded
                if row.tier == "full":
                    self._check_one_unit(doc)
                for rec in self.records.values():
                    rec.without_low_bits()
            # the objects whose tensors lie (or lay) in the restore unit: a trajectory point lacks them
            self.restore_objects: list[str] = list(doc.get("restore_unit", {}).get("objects", []))
            self.values: dict[str, Any] = doc["values"]
            if not (isinstance(self.values, dict) and isinstance(self.values.get("items"), dict)
                    and isinstance(self.values.get("objects"), dict)):
                raise ValueError("its values are not {'items': {...}, 'objects': {...}}")
            # a reader opened before a newer writer upgraded the run meets steps of a newer version
            version = manifest_version(doc, f"step {row.step} of {run_dir} was ")
            self.values["items"] = values.as_current(self.values["items"], version)
            self.world_size = int(doc.get("world_size", 1))  # ranks that wrote the step
            if doc.get("step") != row.step:
                raise ValueError(f"it is the manifest of step {doc.get('step')!r}")
            self._check_predicted()
            self._check_stored_bytes()
        except FormatError:
            raise
        except KeyError as exc:
            raise CorruptionError(f"the manifest of step {row.step} in {run_dir} is damaged: "
                                  f"it has no {exc.args[0]!r}") from None
        except (ValueError, TypeError, AttributeError, RecursionError) as exc:
            raise CorruptionError(f"the manifest of step {row.step} in {run_dir} is damaged: {exc}") from None
        self._prefetched: dict[str, np.ndarray] = {}

    def _manifest(self, reader: StepReader, checksum: str, unit: str) -> bytes:
        what = f"the manifest of step {self.row.step}{unit} in {self.run_dir}"
        try:
            raw = reader.manifest()
        except Exception as exc:
            raise CorruptionError(f"{what} cannot be read: the step's data is damaged ({exc})") from exc
        if checksum_bytes(raw) != checksum:
            raise CorruptionError(f"{what} does not match its checksum: the step's data is damaged")
        return raw

    def _check_one_unit(self, doc: dict) -> None:
        """A step of one unit (tier ``full``) has no restore unit and no rounded tensor
        (only a restore point of two units rounds the tensors its trajectory point keeps):
        one that does is a restore or trajectory point whose index row says otherwise,
        and reading it as whole would take rounded values for exact ones."""
        rounded = next((r for r in self.records.values() if r.keep_bits is not None), None)
        if "restore_unit" in doc or rounded is not None:
            what = (f"tensor {rounded.name!r} is rounded to {rounded.keep_bits} mantissa bits" if rounded is not None
                    else "it names a restore unit")
            raise ValueError(f"{what}, but the index says the step is stored whole, in one unit: "
                             "the index or the step's data is damaged")

    def _add_restore_unit(self, reader: StepReader, doc: dict) -> None:
        """The restore unit's tensors, its manifest checked against the main one's record of it."""
        unit = doc.get("restore_unit")
        if not isinstance(unit, dict) or not isinstance(unit.get("manifest_checksum"), str):
            raise ValueError("it is a restore point's but names no restore unit")
        rest = json.loads(self._manifest(reader, unit["manifest_checksum"], " (its restore unit)"))
        if rest.get("step") != self.row.step:
            raise ValueError(f"its restore unit is of step {rest.get('step')!r}")
        for rec in self.records.values():
            if rec.keep_bits is not None and not rec.has_low_bits:
                raise ValueError(f"tensor {rec.name!r} is rounded to {rec.keep_bits} mantissa bits, but its record "
                                 "names no low bits: the exact value of this restore point is lost")
        for rec in map(TensorRecord.from_json, rest["tensors"]):
            if rec.name in self.records:
                raise ValueError(f"tensor {rec.name!r} is in both of its units")
            lossy = {key: getattr(rec, key) for key in LOSSY_KEYS if getattr(rec, key) is not None}
            if lossy:
                raise ValueError(f"tensor {rec.name!r} of its restore unit is recorded as rounded "
                                 f"({str(lossy)[:200]}): only tensors of the main unit are")
            rec.part = "restore"
            self.records[rec.name] = rec

    def _check_predicted(self) -> None:
        """The tensors a predicted delta reads at this step are here, alike and in the same
        unit, and none is predicted from itself: ``ranks`` orders them (a tensor after those
        it is predicted from), so the values a read decodes never go round in a loop."""
        self.ranks: dict[str, int] = {}
        for rec in self.records.values():
            self._rank(rec, ())

    def _rank(self, rec: TensorRecord, through: tuple[str, ...]) -> int:
        if rec.predictor is None:
            return 0
        if rec.name in self.ranks:
            return self.ranks[rec.name]
        if rec.name in through:
            raise ValueError(f"tensor {rec.name!r} is predicted from itself (through {', '.join(map(repr, through))})")
        rank = 1
        for name in predictors.same_step(rec.predictor):
            other = self.records.get(name)
            if other is None or (other.dtype, other.shape, other.part) != (rec.dtype, rec.shape, rec.part):
                raise ValueError(f"tensor {rec.name!r} is predicted from {name!r}, which the step does not hold as "
                                 "a tensor of the same dtype, shape and unit")
            rank = max(rank, self._rank(other, through + (rec.name,)) + 1)
        self.ranks[rec.name] = rank
        return rank

    def _check_stored_bytes(self) -> None:
        """A tensor's stored bytes lie in its unit: a record that declares more bytes
        than the unit holds is damaged, and is refused before memory is allocated for it."""
        main = unit_path(self.run_dir, self.row)
        for part, path in (("", main), ("restore", os.path.join(os.path.dirname(main), restore_unit(self.row.location)))):
            declared = [(r, r.stored_bytes) for r in self.records.values() if r.part == part]
            if part == "restore":  # the low bits of rounded tensors lie there too
                declared += [(r, r.low_stored) for r in self.records.values() if r.has_low_bits]
            if not declared:
                continue
            stored = unit_bytes(path)
            for rec, nbytes in declared:
                if nbytes > stored:
                    raise ValueError(f"tensor {rec.name!r} declares {nbytes} bytes, more than the "
                                     f"{stored} bytes of the step's data")
            total = sum(nbytes for _, nbytes in declared)
            if total > stored:
                raise ValueError(f"its {len(declared)} tensors declare {total} bytes in all, more than the "
                                 f"{stored} bytes of the step's data")

    def read(self, name: str, verify: bool = True) -> torch.Tensor:
        """Tensor ``name`` in host memory, its checksum verified."""
        rec = self._record(name)
        if name in self._prefetched:
            return torch.from_numpy(self._prefetched.pop(name)).view(torch_dtype(rec.dtype))
        return self._tensor(rec, (0,) * len(rec.shape), rec.shape, verify)

    def prefetch(self, names, into: dict[str, torch.Tensor] | None = None, bases: dict | None = None) -> None:
        """Read these whole tensors together (one batch for the backend), checksums
        verified; each later :meth:`read` of one of them returns it once. ``into``:
        tensors to read straight into (contiguous, CPU, of the stored dtype and shape).
        ``bases``: decoded values of the deltas' bases, ``(step, name) -> bytes``, that
        the caller holds (the others are read)."""
        if self.plain_reads:
            return  # read() reads each
        into = into or {}
        wanted = [self.records[n] for n in names if n in self.records and n not in self._prefetched]
        wanted = [r for r in wanted if r.blocks is None and math.prod(r.shape)]
        raw = [r for r in wanted if r.encoding == "raw"]
        for part in {r.part for r in raw}:  # one batch per unit
            self._prefetch([r for r in raw if r.part == part], into, self.readers[part])
        # a rounded tensor with its low bits is read alone (read()), from both units
        self._prefetch_encoded([r for r in wanted if r.encoding != "raw" and not r.has_low_bits], into, bases)

    def _prefetch(self, wanted: list[TensorRecord], into: dict, reader: StepReader) -> None:
        outs = [self._live_destination(r, into.get(r.name)) for r in wanted]
        fresh = fresh_arrays([(r.shape, storage_dtype(torch_dtype(r.dtype))) for r, o in zip(wanted, outs) if o is None])
        outs = [o if o is not None else next(fresh) for o in outs]
        requests = [(r.name, out, (0,) * len(r.shape)) for r, out in zip(wanted, outs)]
        with self._as_damage("the tensors"):
            reader.read_many(requests)
        for rec, out in zip(wanted, outs):
            try:
                self._check(rec, out, rec.checksum)
            except CorruptionError:  # a batch may read by a table gone stale: read() decides
                with self._as_damage(f"tensor {rec.name!r}"):
                    reader.read(rec.name, out, (0,) * len(rec.shape))
                self._check(rec, out, rec.checksum)
            self._prefetched[rec.name] = out

    def _prefetch_encoded(self, wanted: list[TensorRecord], into: dict, bases: dict | None = None) -> None:
        """Encoded tensors: their stored bytes read in batches (per unit, of at most
        :data:`BATCH_BYTES`), then each decoded straight into its destination (a tensor of
        ``into``, or fresh memory); a predicted delta after the tensor it is predicted from
        (of its unit: listed first). Not remembered as bases: the caller owns what it reads."""
        wanted = sorted(wanted, key=lambda r: self.ranks.get(r.name, 0))
        batches = [batch for part in {r.part for r in wanted}  # each unit in batches of its own
                   for batch in _runs((r for r in wanted if r.part == part), BATCH_BYTES)]
        if bases is None and self._bases is not None:  # the deltas' bases, a step at a time
            bases = self._bases.warm_bases([key for r in wanted for key in r.dependencies(self.row.step)
                                            if key[0] < self.row.step])
        targets: list[tuple[int, int]] = []  # the live memories decoded into: sorted, disjoint
        with ThreadPoolExecutor(DECODERS, thread_name_prefix="dh-decode") as pool:
            for batch in batches:
                # bases are found here, in order (they may read and decode other steps);
                # the decodes themselves, which touch nothing shared, run on the pool
                decoding, decoded, given, rank = [], {}, bases, 0
                for wave in _runs(batch, WAVE_BYTES):
                    with self._as_damage("the tensors"):
                        blobs = self._read_blobs(wave)
                    jobs = []
                    for rec in wave:
                        if self.ranks.get(rec.name, 0) > rank:
                            rank = self.ranks[rec.name]
                            decoding += self._submit(pool, jobs)
                            self._finish(decoding)  # the values it is predicted from, decoded and checked
                            decoding, jobs = [], []
                            given = dict(bases or {})
                            given.update({(self.row.step, n): a.reshape(-1).view(np.uint8)
                                          for n, a in (*self._prefetched.items(), *decoded.items())})
                        live = self._live_destination(rec, into.get(rec.name))
                        if live is not None and not _claim(targets, live):
                            # memory another decode writes (GPT-2's tied lm_head and wte): two
                            # decodes writing it at once would each check the other's bytes; this
                            # one goes to fresh memory and is copied in with the other values
                            live = None
                        out = self._decode_buffer(rec) if live is None else live.reshape(-1).view(np.uint8)
                        jobs.append((rec, blobs.pop(rec.name), out, self._given_bases(rec, given)))
                        decoded[rec.name] = out.view(storage_dtype(torch_dtype(rec.dtype))).reshape(rec.shape)
                    decoding += self._submit(pool, jobs)
                self._finish(decoding)
                self._prefetched.update(decoded)  # each checked: a failed batch leaves none

    def _submit(self, pool: ThreadPoolExecutor, jobs: list[tuple]) -> list:
        """``jobs`` on the pool, one task per decoder (:func:`_shares`)."""
        return [pool.submit(self._decode_all, share) for share in _shares(jobs, DECODERS)]

    def _decode_all(self, jobs: list[tuple]) -> list[tuple]:
        """Decode ``jobs`` (on a decoder); those whose bytes do not check are returned, to be
        read again on the calling thread (:meth:`_finish`: readers are not shared)."""
        failed = []
        for job in jobs:
            try:
                self._decode(*job)
            except CorruptionError:
                failed.append(job)
        return failed

    def _finish(self, decoding: list) -> None:
        """Wait for these tasks of :meth:`_decode_all`; decode each tensor they return again
        from its bytes read with the reader's plain ``read`` (a mapped or batch read may go by
        a table of byte ranges gone stale: hdf5.py), in order, raising the first that still
        fails."""
        for done in decoding:
            for rec, _, out, bases in done.result():
                self._decode_read(rec, out, bases, plain=True)

    def _decode_read(self, rec: TensorRecord, out: np.ndarray, bases: list[np.ndarray], plain: bool) -> None:
        """:meth:`_decode` of ``rec``'s stored bytes, read here (``plain``: as :meth:`_read_blob`)."""
        self._decode(rec, self._read_blob(rec, rec.part, rec.stored, plain=plain), out, bases)

    @contextlib.contextmanager
    def _as_damage(self, what: str, detail: str = ""):
        """A backend's failure to read ``what`` of this step, raised as damage of it (a
        batch has no single tensor to name; a base has no caller to name it)."""
        try:
            yield
        except (CorruptionError, StepNotFoundError):
            raise
        except Exception as exc:
            raise CorruptionError(
                f"{what} of step {self.row.step} in {self.run_dir}{detail} cannot be read: {exc}") from exc

    def _live_destination(self, rec: TensorRecord, live: torch.Tensor | None) -> np.ndarray | None:
        """``live`` as the array to read ``rec`` into, if it can be."""
        if (live is not None and tuple(live.shape) == rec.shape and dtype_name(live.dtype) == rec.dtype
                and live.device.type == "cpu" and live.is_contiguous()):
            return live.detach().view(storage_torch_dtype(live.dtype)).numpy()
        return None

    def read_box(self, name: str, start: tuple[int, ...], count: tuple[int, ...],
                 verify: bool = False) -> torch.Tensor:
        """The box ``start``/``count`` of tensor ``name``.

        Checksums cover whole blocks (the whole tensor, or each rank's part of
        it). With ``verify``, the blocks the box cuts are read whole and checked;
        without, only the box is read.
        """
        rec = self._record(name)
        start, count = tuple(int(s) for s in start), tuple(int(c) for c in count)
        if not (len(start) == len(count) == len(rec.shape) and all(
                s >= 0 and c >= 0 and s + c <= n for s, c, n in zip(start, count, rec.shape))):
            raise ValueError(f"the box at {list(start)} of {list(count)} does not fit tensor {name!r} "
                             f"of shape {list(rec.shape)}")
        return self._tensor(rec, start, count, verify)

    def _tensor(self, rec: TensorRecord, start: tuple[int, ...], count: tuple[int, ...], verify: bool) -> torch.Tensor:
        return torch.from_numpy(self._read_named(rec, start, count, verify)).view(torch_dtype(rec.dtype))

    def _read_named(self, rec: TensorRecord, start: tuple[int, ...], count: tuple[int, ...],
                    verify: bool) -> np.ndarray:
        """:meth:`_read`, a failure of the backend named as damage of the tensor."""
        with self._as_damage(f"tensor {rec.name!r}"):
            return self._read(rec, start, count, verify)

    def _record(self, name: str) -> TensorRecord:
        rec = self.records.get(name)
        if rec is None:
            raise KeyError(f"step {self.row.step} has no tensor {name!r}")
        return rec

    def _check(self, rec: TensorRecord, data: np.ndarray, checksum: str, part: str = "") -> None:
        if checksum_bytes(data.reshape(-1).view(np.uint8)) != checksum:
            raise CorruptionError(
                f"tensor {rec.name!r}{part} of step {self.row.step} in {self.run_dir} does not match "
                "its checksum: the stored data is damaged"
            )

    def _blocks(self, rec: TensorRecord) -> list[dict]:
        """The blocks of ``rec`` (checked with the record when the manifest was read)."""
        if rec.blocks is None:
            return [{"start": [0] * len(rec.shape), "count": list(rec.shape), "checksum": rec.checksum, "part": None}]
        return rec.blocks

    def _read(self, rec: TensorRecord, start: tuple[int, ...], count: tuple[int, ...], verify: bool) -> np.ndarray:
        """The box's stored bytes, as an array of the storage dtype, assembled from its blocks."""
        sdtype = storage_dtype(torch_dtype(rec.dtype))
        if rec.encoding != "raw" and math.prod(rec.shape):
            whole = self.value(rec).view(sdtype).reshape(rec.shape)
            return whole[tuple(slice(s, s + c) for s, c in zip(start, count)) + (...,)].copy()
        out = np.empty(count, dtype=sdtype)
        if not out.size:
            return out
        reader = self.readers[rec.part]
        for b in self._blocks(rec):
            bstart, bcount = tuple(b["start"]), tuple(b["count"])
            common = overlap(start, count, bstart, bcount)
            if common is None:
                continue
            lo, hi = common
            check = verify and b["checksum"]
            if (bstart, bcount) == (tuple(start), tuple(count)):
                data = out  # the box is this block: read in place
            else:
                data = np.empty(bcount if check else tuple(h - l for l, h in zip(lo, hi)), dtype=sdtype)
            first = bstart if data.shape == bcount else lo
            # blocks in a rank's own file are stored alone; in a shared file, in place
            where = tuple(f - s for f, s in zip(first, bstart)) if b.get("part") is not None else first
            reader.read(rec.name, data, where, part=b.get("part"))
            if check:
                self._check(rec, data, b["checksum"], "" if rec.blocks is None else f" (its block at {list(bstart)})")
            if data is not out:
                src = tuple(slice(l - f, h - f) for l, h, f in zip(lo, hi, first))
                dst = tuple(slice(l - s, h - s) for l, h, s in zip(lo, hi, start))
                out[dst] = data[src]
        return out

    def stored(self, rec: TensorRecord, bases: dict | None = None) -> np.ndarray:
        """The stored bytes of ``rec`` (1-D uint8, C order), checked against its checksum
        (``bases``: as :meth:`decoded` takes them)."""
        if rec.encoding != "raw":
            return self.decoded(rec, bases=bases)
        return self._read_named(rec, (0,) * len(rec.shape), rec.shape, True).reshape(-1).view(np.uint8)

    def value(self, rec: TensorRecord) -> np.ndarray:
        """The bytes (1-D uint8) a reader gets of encoded tensor ``rec``: decoded, and for a
        rounded tensor of a restore point its exact bytes (rounded XOR its low bits, read
        from the restore unit and checked against ``exact_checksum``)."""
        rounded = self.decoded(rec)
        if not rec.has_low_bits:
            return rounded
        return self._confirmed(lambda plain: self._exact(rec, rounded, plain))

    def _confirmed(self, attempt):
        """``attempt(plain=False)``; where its bytes fail their check (a mapped or batch read
        may go by a table of byte ranges gone stale: hdf5.py), ``attempt(plain=True)``,
        whose reads go through the reader's plain ``read``."""
        try:
            return attempt(False)
        except CorruptionError:
            if self.plain_reads:
                raise  # its reads were plain already
            return attempt(True)

    def _exact(self, rec: TensorRecord, rounded: np.ndarray, plain: bool) -> np.ndarray:
        blob = self._read_blob(rec, "restore", rec.low_stored, " (its low bits)", plain)
        try:
            exact = add_low_bits(rounded, blob, rec.low_chunks, storage_dtype(torch_dtype(rec.dtype)).itemsize)
        except ValueError as exc:
            raise CorruptionError(f"tensor {rec.name!r} of step {self.row.step} in {self.run_dir}: its low bits "
                                  f"cannot be decoded: {exc}: the restore unit is damaged") from None
        self._check(rec, exact, rec.exact_checksum, " (its exact value, with its low bits)")
        return exact

    def decoded(self, rec: TensorRecord, bases: dict | None = None) -> np.ndarray:
        """The stored bytes (1-D uint8) of encoded tensor ``rec``: its chunks read and
        decompressed, added to the prediction from its bases for a delta, and checked
        against its checksum (always: a part of a tensor decodes the whole of it anyway,
        and a decoded value may become the base of others); bytes from a mapped read that
        do not check are read again with the plain read (:meth:`_confirmed`). The value is
        kept as a base of later reads; ``bases``: values of its bases the caller holds,
        ``(step, name) -> bytes`` (else they are read)."""
        bases = self._given_bases(rec, bases)
        out = self._decode_buffer(rec)
        self._confirmed(lambda plain: self._decode_read(rec, out, bases, plain))
        if self._bases is not None:
            self._bases.remember(self.row, rec.name, out)
        return out

    def _given_bases(self, rec: TensorRecord, bases: dict | None) -> list[np.ndarray]:
        """The values ``rec`` is decoded against (:meth:`TensorRecord.dependencies`) from
        ``bases`` (``(step, name) -> bytes``) if it holds them all, else read."""
        needs = rec.dependencies(self.row.step)
        if bases and all(key in bases for key in needs):
            return [self._sized(rec, step, bases[step, name]) for step, name in needs]
        return self._bases_of(rec, needs)

    def _bases_of(self, rec: TensorRecord, needs: list[tuple[int, str]]) -> list[np.ndarray]:
        pinned: dict[tuple[int, str], np.ndarray] = {}  # the first walk decodes the others: kept for them
        out = []
        for step, name in needs:
            if step == self.row.step and name != rec.name and name in predictors.same_step(rec.predictor or {}):
                # a tensor a predicted delta reads at this step (of a lower rank: _check_predicted)
                out.append(self._sized(rec, step, self.stored(self.records[name])))
            else:
                out.append(self._base(rec, step, name, pinned, needs))
        return out

    def _decode_buffer(self, rec: TensorRecord) -> np.ndarray:
        try:
            return np.empty(rec.nbytes, np.uint8)
        except MemoryError:
            raise CorruptionError(f"tensor {rec.name!r} of step {self.row.step} in {self.run_dir} declares "
                                  f"{rec.nbytes} bytes, more than this process can allocate") from None

    def _decode(self, rec: TensorRecord, blob: np.ndarray, out: np.ndarray, bases: list[np.ndarray]) -> None:
        """Decode ``blob`` into ``out`` against ``bases`` and check the checksum: no state
        of the store is touched, so several threads may decode at once."""
        try:
            itemsize = storage_dtype(torch_dtype(rec.dtype)).itemsize
            if rec.predictor is not None:  # bases: its own at the base step, then those the prediction reads
                predict = predictors.in_chunks(rec.predictor, bases[1:], bases[0])
                decode(blob, rec.chunks, itemsize, out, drop=rec.dropped_bits, dtype=rec.dtype, predict=predict)
            else:
                decode(blob, rec.chunks, itemsize, out, *bases, drop=rec.dropped_bits, dtype=rec.dtype)
        except ValueError as exc:
            raise CorruptionError(f"tensor {rec.name!r} of step {self.row.step} in {self.run_dir} cannot be "
                                  f"decoded: {exc}: the stored data is damaged") from None
        self._check(rec, out, rec.checksum)

    def _read_blobs(self, batch: list[TensorRecord]) -> dict[str, np.ndarray]:
        """The encoded bytes of ``batch`` (records of one unit): views of the mapped file
        where the backend maps it, the others read in one batch."""
        reader = self.readers[batch[0].part]
        blobs = reader.mapped_bytes([(r.name, r.stored) for r in batch])
        unmapped = {r.name: np.empty(r.stored, np.uint8) for r in batch if r.name not in blobs}  # within the unit's size
        reader.read_many([(name, blob, (0,)) for name, blob in unmapped.items() if blob.size])
        blobs.update(unmapped)
        return blobs

    def _read_blob(self, rec: TensorRecord, part: str, nbytes: int, what: str = "",
                   plain: bool = False) -> np.ndarray:
        """``nbytes`` stored bytes of ``rec`` from unit ``part`` (``plain``: with the reader's
        ``read``, not mapped); a failure is damage of it (a value decoded as a base is read
        here, with no caller to name the tensor)."""
        reader = self.readers[part]
        if not nbytes:
            return np.empty(0, np.uint8)
        with self._as_damage(f"tensor {rec.name!r}", what):
            blob = None if plain or self.plain_reads else reader.mapped_bytes([(rec.name, nbytes)]).get(rec.name)
            if blob is None:
                blob = np.empty(nbytes, np.uint8)  # within the unit's size (_check_stored_bytes)
                reader.read(rec.name, blob, (0,))
        return blob

    def _base(self, rec: TensorRecord, step: int, name: str, pinned: dict, keep: list[tuple[int, str]]) -> np.ndarray:
        """The stored bytes of tensor ``name`` at ``step``, a base of ``rec``'s delta."""
        what = f"tensor {rec.name!r} of step {self.row.step} in {self.run_dir} is a delta against step {step}"
        if name != rec.name:
            what += f" (of tensor {name!r})"
        if step >= self.row.step:
            raise CorruptionError(f"{what}, which is not earlier: the step's data is damaged")
        if self._bases is None:
            raise CorruptionError(f"{what}, and this reader has no access to other steps")
        try:
            base = self._bases.base(step, name, self.row.step, pinned, keep)
        except UnreadableBase:
            raise  # said once, by the delta nearest the damage
        except CorruptionError as exc:
            raise UnreadableBase(f"{what}, which cannot be read: {exc}") from exc
        return self._sized(rec, step, base)

    def _sized(self, rec: TensorRecord, step: int, base: np.ndarray) -> np.ndarray:
        if base.size != rec.nbytes:
            raise CorruptionError(f"tensor {rec.name!r} of step {self.row.step} in {self.run_dir} is a delta "
                                  f"against step {step}, where it has {base.size} bytes, not {rec.nbytes}")
        return base

    def close(self) -> None:
        for reader in self.readers.values():
            if reader is not None:
                reader.close()

    def __enter__(self) -> "StepData":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
