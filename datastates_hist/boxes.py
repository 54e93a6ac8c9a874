"""Boxes of an n-dimensional array, each given by its corner ``start`` and its ``count``."""

from __future__ import annotations


def overlap(start: tuple[int, ...], count: tuple[int, ...], other_start: tuple[int, ...],
            other_count: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The box two boxes share, as its lowest corner and the corner past its highest
    (``lo``, ``hi``), or None when they share no element."""
    lo = tuple(max(a, b) for a, b in zip(start, other_start))
    hi = tuple(min(a + n, b + m) for a, n, b, m in zip(start, count, other_start, other_count))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, hi
