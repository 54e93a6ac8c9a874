"""Retention: which committed steps to keep, and what each keeps, as small policy objects.

Policies are data: ``KeepLast(10)`` keeps the ten newest steps, ``KeepEvery(100)``
keeps every step divisible by 100, ``KeepLast(2) | KeepEvery(100)`` both. A step
is kept when any policy keeps it; the newest committed step is always kept.

A Checkpointer given ``keep=`` applies it to its restore points after every
commit, on the flusher thread; given also ``trajectory=Trajectory(...)``, a
restore point that ``keep`` lets go stays as a *trajectory point* (the tensors
the trajectory names, in the step's main unit) when the step is on the
trajectory's grid, and goes away otherwise. Nothing is removed that a kept
step is encoded against (its delta base, :mod:`.deltas`).

Removing checks every doomed row's location first (a damaged index refuses the
whole change), then changes the index rows (one transaction: readers stop seeing
those steps or tensors at once), then deletes the data.
"""

from __future__ import annotations

import fnmatch
import numbers
import os
from dataclasses import dataclass
from typing import Iterable

from .index import Index, StepRow, unit_path
from .items import DELTA, KEY, RAW
from .layout import count_of, restore_unit, steps_dir, unit_bytes


class Policy:
    """A rule that keeps some of a list of steps; ``a | b`` keeps what either keeps."""

    def keep(self, steps: list[int]) -> set[int]:
        raise NotImplementedError

    def keeps_for_good(self, step: int) -> bool:
        """Whether this policy keeps ``step`` whatever steps come after it (a policy
        that cannot tell says True: its steps are stored as if they stayed). A subclass
        that changes :meth:`keep` says it here too: what it lets go is stored raw."""
        return True

    def __or__(self, other: "Policy") -> "KeepAny":
        if not isinstance(other, Policy):
            return NotImplemented
        return KeepAny(_rules(self) + _rules(other))


def _rules(policy: Policy) -> tuple:
    return policy.rules if isinstance(policy, KeepAny) else (policy,)


@dataclass(frozen=True)
class KeepLast(Policy):
    """Keep the ``n`` newest steps."""

    n: int

    def __post_init__(self):
        object.__setattr__(self, "n", count_of(self.n, "KeepLast"))

    def keep(self, steps: list[int]) -> set[int]:
        return set(steps[-self.n:])

    def keeps_for_good(self, step: int) -> bool:
        return False


@dataclass(frozen=True)
class KeepEvery(Policy):
    """Keep every step that is a multiple of ``k``."""

    k: int

    def __post_init__(self):
        object.__setattr__(self, "k", count_of(self.k, "KeepEvery"))

    def keep(self, steps: list[int]) -> set[int]:
        return {s for s in steps if s % self.k == 0}

    def keeps_for_good(self, step: int) -> bool:
        return step % self.k == 0


@dataclass(frozen=True)
class KeepAny(Policy):
    """Keep what any of ``rules`` keeps (``KeepLast(2) | KeepEvery(100)``)."""

    rules: tuple

    def keep(self, steps: list[int]) -> set[int]:
        kept: set[int] = set()
        for rule in self.rules:
            kept |= rule.keep(steps)
        return kept

    def keeps_for_good(self, step: int) -> bool:
        return any(rule.keeps_for_good(step) for rule in self.rules)


def policy_key(keep: Policy | None) -> str:
    """What ``keep`` keeps, as text that ranks compare: the rules of ``a | b`` in any
    order alike; a policy whose text would name its address, by its class alone."""
    if keep is None:
        return "None"
    if isinstance(keep, KeepAny):
        return " | ".join(sorted({policy_key(rule) for rule in keep.rules}))
    text = repr(keep)
    return type(keep).__qualname__ if " at 0x" in text else text


def check_policy(keep) -> Policy | None:
    """``keep`` if it is a policy (or None); a clear TypeError otherwise."""
    if keep is None or isinstance(keep, Policy):
        return keep
    raise TypeError(f"keep= needs a retention policy such as dh.KeepLast(2) | dh.KeepEvery(1000), "
                    f"got {keep!r}")


@dataclass(frozen=True)
class Trajectory:
    """What a step keeps once it is no longer a restore point: the tensors whose
    names match ``patterns`` (globs, as ``"model/*"``), on the steps divisible by
    ``every``.

    ``keep_bits``: trajectory points keep their floating-point tensors (float32,
    float64, float16, bfloat16) rounded to this many explicit mantissa bits (to
    nearest, ties to even: relative error at most ``2**-(keep_bits + 1)`` on normal
    numbers; NaN, infinities and zeros kept), which compresses them several times
    better. Restore points stay exact: the low bits are kept in the step's restore
    unit until the step becomes a trajectory point. A tensor whose dtype has fewer
    mantissa bits (bfloat16 keeps 7), and tensors of other dtypes, are kept exact.
    The statistics (``h.stats``) are those of the exact values. Needs ``keep=``."""

    patterns: tuple[str, ...] = ("model/*",)
    every: int = 1
    keep_bits: int | None = None

    def __init__(self, *patterns: str, every: int = 1, keep_bits: int | None = None):
        patterns = patterns or ("model/*",)
        for p in patterns:
            if not isinstance(p, str) or not p:
                raise TypeError(f"Trajectory needs name patterns (strings such as 'model/*'), got {p!r}")
        object.__setattr__(self, "patterns", tuple(patterns))
        object.__setattr__(self, "every", count_of(every, "Trajectory(every=...)"))
        object.__setattr__(self, "keep_bits", _keep_bits(keep_bits))

    def rounds(self, name: str, dtype: str, step: int) -> int | None:
        """The mantissa bits tensor ``name`` of ``dtype`` keeps at ``step`` once a
        trajectory point, or None when it stays exact."""
        if self.keep_bits is None or not self.on_grid(step) or not self.holds(name):
            return None
        from .rounding import mantissa_bits  # here: numpy and torch only where tensors are written

        bits = mantissa_bits(dtype)
        # a dtype with no more mantissa bits than kept loses nothing: stored exact
        return self.keep_bits if bits is not None and self.keep_bits < bits else None

    def holds(self, name: str) -> bool:
        """Whether tensor ``name`` is part of the trajectory."""
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def on_grid(self, step: int) -> bool:
        return step % self.every == 0

    def check_matches(self, names: list[str], step: int) -> None:
        """Refuse a trajectory that names no tensor of the step (a typo would keep nothing)."""
        if not any(self.holds(n) for n in names):
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise ValueError(f"Trajectory({', '.join(map(repr, self.patterns))}) matches no tensor of step {step} "
                             f"(its tensors: {shown})")


# the longest explicit mantissa of a dtype rounded (float64's; codecs.MAX_KEEP_BITS)
MAX_KEEP_BITS = 52


def _keep_bits(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)  # numpy's integers too
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_KEEP_BITS:
        raise ValueError(f"Trajectory(keep_bits=...) needs a whole number of mantissa bits from 1 to "
                         f"{MAX_KEEP_BITS} (float32 has 23, bfloat16 7), got {value!r}")
    return value


def check_trajectory(trajectory) -> Trajectory | None:
    if trajectory is None or isinstance(trajectory, Trajectory):
        return trajectory
    raise TypeError(f"trajectory= needs dh.Trajectory('model/*', every=1), got {trajectory!r}")


@dataclass(frozen=True)
class Retention:
    """A Checkpointer's policies: which restore points stay (``keep``; None: all)
    and what the others keep (``trajectory``; None: nothing, they go away)."""

    keep: Policy | None = None
    trajectory: Trajectory | None = None

    def __post_init__(self):
        if self.keep is None and self.trajectory is not None and self.trajectory.keep_bits is not None:
            raise ValueError(
                f"Trajectory(keep_bits={self.trajectory.keep_bits}) rounds the steps that become trajectory "
                "points, but without keep= every step stays an exact restore point: pass keep= "
                "(dh.KeepLast(2) | dh.KeepEvery(1000), say) or leave keep_bits out")

    @property
    def split(self) -> bool:
        """Whether restore points are written as two units (trajectory tensors, the rest)."""
        return self.keep is not None and self.trajectory is not None

    def anchor(self, step: int) -> bool:
        """Whether ``step`` stays as long as the run: only such steps are delta bases."""
        if self.keep is None:
            return True
        return self.trajectory is not None and self.trajectory.on_grid(step)

    def may_delta(self, name: str) -> bool:
        """Whether tensor ``name`` may be encoded against an anchor (it lives as long as one)."""
        if self.keep is None:
            return True
        return self.trajectory is not None and self.trajectory.holds(name)

    def step_plan(self, step: int, codec: str) -> "StepPlan":
        return StepPlan(step, codec, self)

    def let_go(self, rows: list[StepRow]) -> tuple[list[int], list[int]]:
        """``(demote, remove)``: the restore points that ``keep`` lets go and become
        trajectory points, and the steps that go away."""
        if self.keep is None:
            return [], []
        tiers = {r.step: r.tier for r in rows if r.tier != "trajectory"}
        restore = sorted(tiers)
        kept = set(restore[-1:]) | self.keep.keep(restore)
        demote, remove = [], []
        for step in restore:
            if step in kept:
                continue
            if self.trajectory is None or not self.trajectory.on_grid(step):
                remove.append(step)
            elif tiers[step] == "restore":
                demote.append(step)
            # a step of one unit on the grid (written without a trajectory) cannot drop its
            # other tensors without a rewrite: it stays a restore point
        return demote, remove


def policies(keep_last: int | None = None, keep_every: int | None = None) -> list:
    out = []
    if keep_last is not None:
        out.append(KeepLast(keep_last))
    if keep_every is not None:
        out.append(KeepEvery(keep_every))
    if not out:
        raise ValueError("say what to keep: keep_last and/or keep_every")
    return out


def doomed(steps: list[int], rules: Iterable) -> list[int]:
    """The steps no rule keeps (never the newest)."""
    steps = sorted(steps)
    kept = set(steps[-1:])
    for rule in rules:
        kept |= rule.keep(steps)
    return [s for s in steps if s not in kept]


def step_bytes(run_dir: str, index: Index, steps: list[int]) -> dict[int, int]:
    """step -> the bytes its data takes on disk (what removing it frees), for
    the committed ones of ``steps``.

    Raises:
        CorruptionError: a row names data outside ``steps/`` or a symbolic link.
    """
    rows = [r for r in (index.step_row(s) for s in steps) if r is not None]
    return {r.step: unit_bytes(unit_path(run_dir, r)) + (
        unit_bytes(os.path.join(steps_dir(run_dir), restore_unit(r.location))) if r.tier == "restore" else 0)
        for r in rows}


# the codecs a writer is asked for: each stores a tensor in the encoding of that name
CODECS = (DELTA, KEY, RAW)


@dataclass(frozen=True)
class StepPlan:
    """How one step is stored: in which unit each tensor goes, and how it is encoded
    (``codec``: ``delta`` against an anchor where :mod:`.deltas` may, else ``key``:
    compressed alone; or ``raw``)."""

    step: int
    codec: str
    retention: Retention

    @property
    def anchor(self) -> bool:
        return self.retention.anchor(self.step)

    @property
    def passing(self) -> bool:
        """Whether ``keep`` will let this step go as a restore point (it keeps it only
        while it is among the newest)."""
        keep = self.retention.keep
        return keep is not None and not keep.keeps_for_good(self.step)

    def encodes(self, name: str) -> bool:
        """Whether tensor ``name`` is stored compressed. What retention deletes once the
        step is no longer among the newest restore points (its restore unit, or the whole
        step when it does not stay as a trajectory point) is stored raw: compressing it
        costs the flush CPU at every step (about 60 ms for the small GPT's Adam state) to
        save disk for a few steps."""
        if self.codec == RAW:
            return False
        return not self.passing or (self.anchor and self.part(name) == "")

    def part(self, name: str) -> str:
        """The unit of tensor ``name``: "" the main one, "restore" the restore unit."""
        return "restore" if self.retention.split and not self.retention.trajectory.holds(name) else ""

    def may_delta(self, name: str) -> bool:
        return self.codec == DELTA and self.retention.may_delta(name)

    def keep_bits(self, name: str, dtype: str) -> int | None:
        """The mantissa bits tensor ``name`` keeps in the main unit (its low bits go to
        the restore unit), or None: stored exact. Only a step of two units on the
        trajectory's grid is rounded (off the grid, a restore point is removed, never
        demoted)."""
        if not self.retention.split:
            return None
        return self.retention.trajectory.rounds(name, dtype, self.step)


def key_every_count(key_every) -> int:
    return count_of(key_every, "key_every")


def check_codec(codec) -> str:
    if codec not in CODECS:
        raise ValueError(f"codec= must be one of {', '.join(map(repr, CODECS))}, got {codec!r}")
    return codec


def remove_steps(run_dir: str, index: Index, steps: list[int]) -> list[int]:
    """Delete committed steps: index rows first (atomically), then their data.

    Raises:
        CorruptionError: a row names data outside ``steps/`` or a symbolic link;
            then nothing is deleted.
    """
    from .backends import get_backend

    rows = [r for r in (index.step_row(s) for s in steps) if r is not None]
    for row in rows:
        unit_path(run_dir, row)  # every row, before anything is deleted
    index.delete_steps([r.step for r in rows])
    for row in rows:
        backend = get_backend(row.backend)
        if row.tier == "restore":
            backend.remove_step(steps_dir(run_dir), restore_unit(row.location))
        backend.remove_step(steps_dir(run_dir), row.location)
    return [r.step for r in rows]


def demote_steps(run_dir: str, index: Index, steps: list[int]) -> list[int]:
    """Make restore points trajectory points: each step's index rows first (one
    transaction: readers see it whole or demoted), then its restore unit."""
    from .backends import get_backend

    rows = [r for r in (index.step_row(s) for s in steps) if r is not None and r.tier == "restore"]
    for row in rows:
        unit_path(run_dir, row)
        index.demote_step(row.step)
        get_backend(row.backend).remove_step(steps_dir(run_dir), restore_unit(row.location))
    return [r.step for r in rows]


def protect_bases(index: Index, doomed_steps: list[int]) -> list[int]:
    """``doomed_steps`` without the delta bases of the steps that stay (and their
    bases in turn): removing one would leave a kept step undecodable."""
    if not doomed_steps:
        return []
    # a base is an earlier step (or the step itself): only steps from the first doomed
    # one on can lead to a doomed step, so the rest of the run is not read (every commit)
    bases: dict[int, set[int]] = {}
    for step, base in index.delta_bases(since=min(doomed_steps)):
        bases.setdefault(step, set()).add(base)
    doomed_set = set(doomed_steps)
    frontier = [s for s in bases if s not in doomed_set]
    needed: set[int] = set()
    while frontier:
        for base in bases.get(frontier.pop(), ()):
            if base not in needed:
                needed.add(base)
                frontier.append(base)
    return [s for s in doomed_steps if s not in needed]


def apply_retention(run_dir: str, index: Index, retention: Retention,
                    kept_whole: set[int] | None = None) -> tuple[list[int], list[int]]:
    """After a commit: demote and remove what ``retention`` lets go; ``(demoted, removed)``.
    ``kept_whole``: the restore points found not to hold the trajectory in their main unit
    (:func:`_keeps_the_trajectory`), added to as found (a committed step does not change)."""
    if retention.keep is None:  # nothing to let go: the run's rows are not read (every commit)
        return [], []
    kept_whole = set() if kept_whole is None else kept_whole
    demote, remove = retention.let_go(index.restore_rows())
    kept_whole.update(s for s in demote if s not in kept_whole and not _keeps_the_trajectory(
        index, retention.trajectory, s))
    demote = [s for s in demote if s not in kept_whole]
    if not (demote or remove):
        return [], []
    return demote_steps(run_dir, index, demote), remove_steps(run_dir, index, protect_bases(index, remove))


def _keeps_the_trajectory(index: Index, trajectory: Trajectory, step: int) -> bool:
    """Whether restore point ``step``'s main unit holds every tensor of it that
    ``trajectory`` keeps, at least as exactly: else (a run reopened with a wider or an
    exact trajectory) demoting it would lose what the trajectory in force keeps, and it
    stays a restore point, as a step of one unit does."""
    for name, part, bits in index.tensor_parts(step):
        if trajectory.holds(name) and (part != "" or bits is not None and (
                trajectory.keep_bits is None or trajectory.keep_bits > bits)):
            return False
    return True


def newest_restore_point(index: Index) -> int | None:
    """The step prune keeps whatever its rules say, so that the run stays restorable
    (the newest step may be a trajectory point: a truncate() onto one, say)."""
    rows = index.restore_rows()
    return rows[-1].step if rows else None


def unkept(index: Index, steps: list[int], rules: Iterable) -> list[int]:
    """Of ``steps``, the ones no rule keeps: never the newest, nor the newest restore point."""
    newest = newest_restore_point(index)
    return [s for s in doomed(steps, rules) if s != newest]


def prunable(index: Index, rules: Iterable) -> list[int]:
    """The steps no rule keeps, but the delta bases of the steps that stay."""
    return protect_bases(index, unkept(index, index.steps(), rules))


def prune_index(run_dir: str, index: Index, rules: Iterable, dry_run: bool = False) -> list[int]:
    """Remove the steps no rule keeps (but the delta bases of steps that stay)."""
    victims = prunable(index, rules)
    if dry_run or not victims:
        return victims
    _check_kept_steps(run_dir, index, victims)
    return remove_steps(run_dir, index, victims)


def _check_kept_steps(run_dir: str, index: Index, victims: list[int]) -> None:
    """Refuse (nothing deleted) unless every step kept after the first victim opens with
    its manifest and index rows agreeing: the bases kept are the ones the index names,
    and a kept delta whose manifest names another would lose its base."""
    from .errors import CorruptionError
    from .store import Store

    doomed = set(victims)
    store = Store(run_dir)
    try:
        for step in index.steps():
            if step > min(victims) and step not in doomed:
                try:
                    with store.open_step(step):
                        pass
                except CorruptionError as exc:
                    raise CorruptionError(f"nothing was pruned: step {step}, which stays, cannot be checked: {exc}; "
                                          f"check the run with: datastates-hist verify {run_dir}") from None
    finally:
        store.close()
