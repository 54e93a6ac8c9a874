"""The commit protocol, in one place.

1. The flusher has put every tensor of the step to the backend's writer (two
   writers for a restore point written as two units: its main unit, with the
   trajectory's tensors, and its restore unit, with the others).
2. ``writer.finish(manifest)`` writes the manifest (the step's records and
   plain values), fsyncs every byte and renames the step's file into place;
   a restore unit first, its manifest's checksum recorded in the main one's.
3. One SQLite transaction inserts the step's row, its tensor rows and its
   scalars (the numbers among its values, :mod:`.scalars`).
4. With ``keep=`` policies, retention demotes or removes older steps
   (:func:`.retention.apply_retention`).

Only step 3 makes the step visible. A crash before it leaves data that no
index row names; the next writer removes it (:func:`remove_uncommitted`),
unless that data is older than the index itself (then the index, not the
data, is suspect: the writer refuses and ``datastates-hist repair`` rebuilds it).

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
import stat
import time
import warnings

from .backends import StepWriter
from .digest import checksum_bytes
from .durable import remove_tree
from .errors import CheckpointError, CorruptionError
from .index import FORMAT_VERSION, Index, StepRow, check_location
from .items import TensorRecord, under
from .layout import PARTIAL, restore_unit, step_of_unit, steps_dir
from .retention import Retention, apply_retention
from .scalars import scalars_of
from .sharding import merge_records, replicated_problem


class Committer:
    """Where the flusher's steps go: it opens each step's writer in the run's backend and
    commits the step, alone or together with every rank of ``group``.

    Its methods run on the flusher thread, which owns its SQLite connection (a
    connection belongs to one thread); :meth:`agree` and :meth:`close` also in the
    caller's thread, once the flusher is idle or stopped. ``own_prefix``: the values
    under it are this rank's own (its RNG states); every other value is the same on
    every rank.
    """

    def __init__(self, run_dir: str, backend, backend_name: str, group, own_prefix: str,
                 retention: Retention | None = None):
        self.run_dir, self.backend, self.backend_name = run_dir, backend, backend_name
        self.group, self.own_prefix = group, own_prefix
        self.retention = retention or Retention()
        self.index: Index | None = None
        self.removed: list[int] = []  # the steps retention removed after the last commit
        self.kept_whole: set[int] = set()  # restore points retention may not demote (apply_retention)
        # several ranks: whether the ranks agreed to begin the step being written, and
        # why no rank may write any more (one closed its Checkpointer while another wrote)
        self.begun = False
        self.ended: str | None = None
        self.warned: set[str] = set()  # plain values found to differ between ranks (rank 0's are kept)

    def agree(self, action: dict) -> str | None:
        """With several ranks: every rank says what it does next (``action``, see
        :func:`disagreement`), so that no rank waits forever in a collective that another
        never makes; why they may not go on, or None. A rank that closed while others
        did something else ends the ranks' writing: every later action fails at once."""
        if self.ended is None:
            error, ended = disagreement(self.group.allgather(action))
            if ended:
                self.ended = error
            return error
        return self.ended

    def open_writers(self, ckpt) -> dict[str, StepWriter]:
        """The writers of ``ckpt``'s units: ``{"": main}``, and ``"restore"`` for a
        restore point written as two units. With several ranks, the ranks first agree
        to begin the step (:meth:`agree`); RankFailure on every rank if not."""
        folder = steps_dir(self.run_dir)
        if self.group.size > 1:
            self.begun = False
            error = self.agree({"do": "write", "step": ckpt.step, "error": _describe(ckpt.error)})
            if error is not None:
                raise RankFailure(f"the ranks did not all write step {ckpt.step}: {error}")
            self.begun = True
            return {"": self.backend.begin_step(folder, ckpt.step, group=self.group)}
        writers = {"": self.backend.begin_step(folder, ckpt.step)}
        if ckpt.plan is not None and ckpt.plan.retention.split:
            try:
                writers["restore"] = self.backend.begin_step(folder, ckpt.step, part="restore")
            except BaseException:
                writers[""].abort()
                raise
        return writers

    def commit(self, ckpt, writers: dict[str, StepWriter], records: list[TensorRecord]) -> None:
        """Commit ``ckpt`` (a failed one is not committed; with several ranks every rank
        still takes part, to agree on the outcome), then apply retention. Raises when
        the commit failed."""
        if self.index is None and self.group.root:
            try:
                self.index = Index(self.run_dir, create=True)
            except Exception as exc:
                if self.group.size == 1:
                    raise
                ckpt.fail(exc)  # the other ranks learn it at the commit
        if self.group.size == 1:
            if ckpt.error is None:
                commit_step(self.index, self.backend_name, ckpt.step, writers, records, ckpt.values)
                self._apply_retention(ckpt.step)
            return
        if not self.begun:  # the ranks agreed not to begin it: each knows it failed
            raise ckpt.error or RankFailure(f"step {ckpt.step} was not begun")
        self.begun = False
        writer = writers.get("")
        own = {key: {k: v for k, v in ckpt.values.get(key, {}).items() if under(k, self.own_prefix)}
               for key in ("items", "objects")}
        differ = commit_collective(self.group, self.index, self.backend_name, ckpt, writer, records, own,
                                   _value_digests(ckpt.values.get("items", {}), self.own_prefix))
        if self.group.root:
            self._warn_values_differ(ckpt.step, differ)
            self._apply_retention(ckpt.step)

    def _warn_values_differ(self, step: int, differ: list[list]) -> None:
        """Plain values are stored as rank 0 has them: say so, once per value, where another
        rank's differs (a per-rank data position, say, would be lost without a word)."""
        new = [(name, rank) for name, rank in differ if name not in self.warned]
        if new:
            self.warned.update(name for name, _ in new)
            shown = ", ".join(f"{name!r} (rank {rank})" for name, rank in new[:5])
            warnings.warn(f"datastates-hist: at step {step} of {self.run_dir}, other ranks' plain values differ "
                          f"from rank 0's: {shown}{' and more' if len(new) > 5 else ''}; the history keeps rank "
                          "0's (keep per-rank state in tensors, as blocks of a global tensor)",
                          RuntimeWarning, stacklevel=1)

    def _apply_retention(self, step: int) -> None:
        """Retention after the commit of ``step``; a failure keeps more steps than asked,
        never fewer, and does not fail the step (it is committed): it is reported."""
        self.removed = []
        try:
            self.removed = apply_retention(self.run_dir, self.index, self.retention, self.kept_whole)[1]
        except Exception as exc:
            warnings.warn(f"datastates-hist: retention after step {step} in {self.run_dir} failed, "
                          f"older steps are kept: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=1)

    def close(self) -> None:
        """After the last commit. With several ranks, the ranks agree that they all close:
        a rank still writing a step fails it (and writes no more) instead of waiting for
        this one forever. Raises CheckpointError when they did not all write the same steps."""
        try:
            if self.group.size > 1 and self.ended is None:
                error = self.agree({"do": "close"})
                if error is not None:
                    raise CheckpointError(f"the ranks did not all write the same steps to {self.run_dir}: {error}")
        finally:
            if self.index is not None:
                self.index.close()
                self.index = None


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


def commit_step(index: Index, backend: str, step: int, writers: dict[str, StepWriter],
                records: list[TensorRecord], values: dict) -> StepRow:
    """Finish the step's units (the restore unit first) and commit the step."""
    more, tier = {}, "full"
    if "restore" in writers:
        kept = [r for r in records if r.part == "restore"]
        restore_manifest = manifest_bytes(step, kept, {"items": {}, "objects": {}}, unit="restore")
        writers["restore"].finish(restore_manifest)
        # the objects a trajectory point cannot restore: those with tensors in the restore unit
        objects = sorted(p for p in values["objects"] if any(under(r.name, p) for r in kept))
        more["restore_unit"] = {"manifest_checksum": checksum_bytes(restore_manifest), "objects": objects}
        records = [r for r in records if r.part != "restore"] + kept  # the main unit's first
        tier = "restore"
    manifest = manifest_bytes(step, [r for r in records if r.part == ""], values, **more)
    try:
        location = writers[""].finish(manifest)
    except BaseException:
        if "restore" in writers:
            remove_tree(writers["restore"].final)
        raise
    return record_step(index, backend, step, location, records, manifest, scalars_of(values["items"]), tier)


def record_step(index: Index, backend: str, step: int, location: str,
                records: list[TensorRecord], manifest: bytes,
                scalars: dict[str, int | float] | None = None, tier: str = "full") -> StepRow:
    row = StepRow(
        step=step, time=time.time(), backend=backend, location=location,
        nbytes=sum(r.nbytes for r in records), ntensors=len(records), tier=tier,
        manifest_checksum=checksum_bytes(manifest),
    )
    index.commit_step(row, records, scalars)  # one transaction: the step with its scalars
    return row


class RankFailure(RuntimeError):
    """Another rank's part of a collective checkpoint failed."""


def _describe(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def disagreement(everyone: list[dict]) -> tuple[str | None, bool]:
    """Why the ranks may not go on, from what each does next (every rank reaches the same
    verdict from the same list): ``{"do": "write", "step": n, "error": why its snapshot
    failed or None}``, ``{"do": "close"}``, ``{"do": "truncate", "after": n}`` or
    ``{"do": "prune", ...its arguments}``. Returns ``(error or None, ended)``: ``ended``
    when some closed while others did something else (they must stop writing)."""
    closing = [r for r, g in enumerate(everyone) if g["do"] == "close"]
    other = next((r for r, g in enumerate(everyone) if g["do"] != "close"), None)
    if closing and other is not None:
        return (f"rank {closing[0]} {_doing(everyone[closing[0]])} while rank {other} {_doing(everyone[other])}: "
                f"{ALIKE}"), True
    first = {k: v for k, v in everyone[0].items() if k != "error"}
    for rank, g in enumerate(everyone):
        if {k: v for k, v in g.items() if k != "error"} != first:
            rule = STEPS_ALIKE if g["do"] == first["do"] == "write" else ALIKE
            return f"rank {rank} {_doing(g)} while rank 0 {_doing(first)}: {rule}", False
    return next((f"rank {r} of {len(everyone)}: {g['error']}" for r, g in enumerate(everyone) if g.get("error")),
                None), False


STEPS_ALIKE = "write() must be called on every rank with the same steps"
ALIKE = "write(), truncate(), prune() and close() must be called on every rank alike, in the same order"


def _doing(action: dict) -> str:
    if action["do"] == "write":
        return f"wrote step {action['step']}"
    if action["do"] == "close":
        return "closed its Checkpointer"
    arguments = ", ".join(f"{k}={v!r}" for k, v in action.items() if k not in ("do", "error"))
    return f"called {action['do']}({arguments})"


def _value_digests(items: dict, own_prefix: str) -> dict[str, str]:
    """A checksum of each plain value every rank holds (not this rank's own)."""
    return {name: checksum_bytes(json.dumps(value, sort_keys=True, allow_nan=True, separators=(",", ":")).encode())
            for name, value in items.items() if not under(name, own_prefix)}


def commit_collective(group, index: Index | None, backend: str, ckpt, writer, records: list[TensorRecord],
                      own_values: dict, value_digests: dict[str, str] | None = None) -> list[list]:
    """Commit ``ckpt`` on every rank of ``group`` together, or on none.

    ``own_values``: the plain values only this rank holds (its RNG states);
    rank 0's values stand for every other value. ``index`` is rank 0's.
    Raises on every rank when any rank failed. Returns, at rank 0 of a committed
    step, ``[name, rank]`` of each plain value a rank holds otherwise than rank 0, the
    first such rank (``value_digests``: a checksum of each, :func:`_value_digests`).
    """
    mine = {"step": ckpt.step, "error": _describe(ckpt.error),
            "records": [r.to_json() for r in records] if ckpt.error is None else [], "values": own_values,
            "replicated": ckpt.replicated, "digests": value_digests or {}}
    gathered = group.gather(mine)
    verdict, manifest, merged = {"error": None}, None, []
    if group.root:
        verdict["error"] = _first_error(gathered, ckpt.step)
        try:  # any exception becomes the verdict: the other ranks wait for it
            if verdict["error"] is None:
                problem = replicated_problem([g["replicated"] for g in gathered])
                verdict["error"] = problem and f"rank 0 (comparing the ranks' tensors): {problem}"
            if verdict["error"] is None:
                parts = not writer.shared  # one file per rank (backends.ranks); rank 0's writer is open
                merged = merge_records([g["records"] for g in gathered], parts)
                values = {"items": dict(ckpt.values["items"]), "objects": dict(ckpt.values["objects"])}
                for g in gathered:
                    for key in ("items", "objects"):
                        values[key].update(g["values"].get(key, {}))
                manifest = manifest_bytes(ckpt.step, merged, values, world_size=group.size,
                                          layout="ranks" if parts else "shared")
        except Exception as exc:
            verdict["error"] = f"rank 0 (merging the ranks' blocks): {_describe(exc)}"
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
                    record_step(index, backend, ckpt.step, writer.publish(), merged, manifest,
                                scalars_of(values["items"]))
                except BaseException as exc:
                    verdict["error"] = f"rank 0 (publishing): {_describe(exc)}"
        verdict = group.bcast(verdict)
    if verdict["error"] is not None:
        _abort_all(group, writer)
        ckpt.fail(RankFailure(f"the ranks did not all write step {ckpt.step}: {verdict['error']}"))
        raise ckpt.error
    if not group.root:
        return []
    ours, differ = gathered[0]["digests"], {}
    for rank, g in enumerate(gathered[1:], start=1):
        for name in sorted(set(ours) | set(g["digests"])):
            if ours.get(name) != g["digests"].get(name):
                differ.setdefault(name, rank)
    return [[name, rank] for name, rank in differ.items()]


def _first_error(gathered: list[dict], step: int) -> str | None:
    for rank, g in enumerate(gathered):
        if g["step"] != step:
            return (f"rank {rank} wrote step {g['step']} while rank 0 wrote step {step}: "
                    "write() must be called on every rank with the same steps")
        if g["error"]:
            return f"rank {rank} of {len(gathered)}: {g['error']}"
    return None


def _abort_all(group, writer) -> None:
    # a writer whose collective close would wait for a rank without one is abandoned
    together = all(group.allgather(writer is not None))
    if writer is not None:
        try:
            writer.abort() if together else writer.abandon()
        except BaseException:
            pass
    group.barrier()
    if group.root and writer is not None:
        writer.remove()


# File times lag time.time() by up to a clock tick (and FAT keeps them to 2 s): a unit
# written just after its index was created may look a little older than the index.
CLOCK_SLACK_S = 2.0


def remove_uncommitted(steps_dir: str, index: Index) -> list[str]:
    """Delete step data that no committed row names (left by a crash); the entries removed.

    Refuses (``CorruptionError``, nothing changed) when a finished unit (not
    ``.partial``) that no row names is older than the index itself: the index is
    then younger than the step data (lost and partly rebuilt, or replaced), and
    such a unit may be a committed step rather than a crash's leftover. A
    symbolic link is unlinked, never followed: its target is not the run's.
    """
    # a row naming other data (a damaged index) must not get its step's own unit deleted
    committed, rows = set(), {}
    for row in index.step_rows():
        committed.add(check_location(index.run_dir, row))
        rows[row.step] = row
        if row.tier == "restore":
            committed.add(restore_unit(row.location))
    unnamed = [e for e in sorted(os.listdir(steps_dir)) if e not in committed]
    _refuse_units_older_than_index(index, steps_dir, unnamed)
    _refuse_units_of_committed_steps(index, steps_dir, unnamed, rows)
    for entry in unnamed:
        remove_tree(os.path.join(steps_dir, entry))  # a link itself, never its target
    return unnamed


def _refuse_units_of_committed_steps(index: Index, steps_dir: str, unnamed: list[str],
                                     rows: dict[int, StepRow]) -> None:
    """A finished unit of a committed step that its row does not name is left by one
    thing only: a demotion cut short (the row says trajectory and has no rows of the
    restore unit any more; the unit is then deleted). Any other is a row that lies
    about its own step (its location or tier damaged): nothing is deleted."""
    restore_rows = None  # read only when needed: a scan of every tensor row
    kept = []
    for entry in unnamed:
        step = step_of_unit(entry)
        row = rows.get(step) if step is not None and not entry.endswith(PARTIAL) else None
        if row is None:
            continue
        if restore_rows is None:
            restore_rows = index.steps_with_restore_rows()
        demoted = row.tier == "trajectory" and entry == restore_unit(row.location) and step not in restore_rows
        if not demoted:
            kept.append((entry, row))
    if kept:
        run_dir = os.path.dirname(steps_dir)
        entry, row = kept[0]
        raise CorruptionError(
            f"the index of {run_dir} says step {row.step} is a {row.tier} step stored as {row.location}, but "
            f"{entry} of that step is there too ({len(kept)} such unit(s)): the index is damaged, so they may be "
            f"committed data; nothing was changed. Rebuild the index with: datastates-hist repair {run_dir}")


def _refuse_units_older_than_index(index: Index, steps_dir: str, unnamed: list[str]) -> None:
    created = _created(index)
    if created is None:
        return
    older = []
    for entry in unnamed:
        if entry.endswith(PARTIAL):
            continue  # never committed
        try:
            st = os.lstat(os.path.join(steps_dir, entry))
        except FileNotFoundError:
            continue
        if not stat.S_ISLNK(st.st_mode) and st.st_mtime < created - CLOCK_SLACK_S:
            older.append(entry)
    if older:
        run_dir = os.path.dirname(steps_dir)
        shown = ", ".join(older[:5]) + (f" and {len(older) - 5} more" if len(older) > 5 else "")
        raise CorruptionError(
            f"the index of {run_dir} does not name {len(older)} finished step unit(s) older than the index "
            f"itself ({shown}): the index is younger than its step data (lost and rebuilt, or replaced), so "
            f"they may be committed steps; nothing was changed. Rebuild the index with: datastates-hist repair "
            f"{run_dir} (a step whose removal by prune or truncate was cut short then comes back: remove it again)"
        )


def _created(index: Index) -> float | None:
    """When the index was created (its ``created`` meta value), if it says."""
    try:
        return float(index.meta("created"))
    except (TypeError, ValueError):
        return None
