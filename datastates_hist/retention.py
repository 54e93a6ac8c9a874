"""Retention: which committed steps to keep, as small policy objects, and pruning.

Policies are data: ``KeepLast(10)`` keeps the ten newest steps, ``KeepEvery(100)``
keeps every step divisible by 100. A step is kept when any policy keeps it; the
newest committed step is always kept. Pruning checks every doomed row's
location first (a damaged index refuses the whole prune, changing nothing),
then deletes the index rows (one transaction: readers stop seeing those steps
at once), then the step data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .index import Index, unit_path
from .layout import steps_dir, unit_bytes


@dataclass(frozen=True)
class KeepLast:
    """Keep the ``n`` newest steps."""

    n: int

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"KeepLast needs n >= 1, got {self.n}")

    def keep(self, steps: list[int]) -> set[int]:
        return set(steps[-self.n:])


@dataclass(frozen=True)
class KeepEvery:
    """Keep every step that is a multiple of ``k``."""

    k: int

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"KeepEvery needs k >= 1, got {self.k}")

    def keep(self, steps: list[int]) -> set[int]:
        return {s for s in steps if s % self.k == 0}


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
    return {r.step: unit_bytes(unit_path(run_dir, r)) for r in rows}


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
        get_backend(row.backend).remove_step(steps_dir(run_dir), row.location)
    return [r.step for r in rows]


def prune_index(run_dir: str, index: Index, rules: Iterable, dry_run: bool = False) -> list[int]:
    """Remove the steps no rule keeps."""
    victims = doomed(index.steps(), rules)
    if dry_run or not victims:
        return victims
    return remove_steps(run_dir, index, victims)
