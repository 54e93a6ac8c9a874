"""The few error classes of datastates-hist.

Each subclasses a built-in so that callers can catch what they already know.
Messages name the item, what was expected, what was found, and how to fix it.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or committed (raised at the next call)."""


class StoreNotFoundError(FileNotFoundError):
    """The run directory, or its index, does not exist."""


class StepNotFoundError(LookupError):
    """The requested step is not committed in the run."""


class StepOrderError(ValueError):
    """A write names a step that is not after the newest committed one."""


class StoreLockedError(RuntimeError):
    """Another process holds the writer lock of the run."""


class FormatError(ValueError):
    """The store was written in a format this version cannot read."""


class CorruptionError(OSError):
    """Stored data does not match its checksum, or cannot be parsed."""


class RestoreMismatchError(ValueError):
    """A strict restore found missing, unexpected or mismatched items.

    Attributes:
        missing: names the target expects and the step does not hold.
        unexpected: names the step holds and the target does not expect.
        mismatched: ``(name, expected, found)`` for shape, dtype or type mismatches.
    """

    def __init__(self, step: int, missing, unexpected, mismatched,
                 advice: str = "pass strict=False to load what matches and get the rest reported"):
        self.step = step
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)
        lines = [f"step {step} does not match the objects to restore:"]
        if self.missing:
            lines.append(f"  missing from the step ({len(self.missing)}): {_few(self.missing)}")
        if self.unexpected:
            lines.append(f"  unexpected in the step ({len(self.unexpected)}): {_few(self.unexpected)}")
        for name, expected, found in self.mismatched[:20]:
            lines.append(f"  {name}: expected {expected}, found {found}")
        lines.append(advice)
        super().__init__("\n".join(lines))


class ShapeChangeError(ValueError):
    """A tensor's shape (or dtype) differs between the steps asked for (one xarray
    variable over steps needs one shape)."""


def _few(names, limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
