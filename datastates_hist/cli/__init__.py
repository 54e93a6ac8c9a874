"""The ``datastates-hist`` command line: look at, check and manage a run's history.

Each command is a module of this package with ``add_parser(subparsers)`` and
``run(args) -> int``. Every error is printed once, as one line on stderr
(``datastates-hist: ...``), never as a traceback, and ends the command with its
exit code (see :data:`EXIT_CODES`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sqlite3
import sys

import datastates_hist

from ..errors import (
    CheckpointError, CorruptionError, FormatError, StepNotFoundError, StoreLockedError, StoreNotFoundError,
)

COMMANDS = ("ls", "show", "diff", "trace", "export", "du", "prune", "verify", "repair", "import_")

EXIT_FAILED, EXIT_USAGE, EXIT_MISSING, EXIT_DAMAGED, EXIT_LOCKED, EXIT_IO, EXIT_BUG = 1, 2, 3, 4, 5, 6, 7
EXIT_INTERRUPTED = 130

EXIT_CODES = {
    0: "success",
    EXIT_FAILED: "a check failed (verify found damage; repair could not commit every step)",
    EXIT_USAGE: "bad usage (arguments, options, a missing optional package)",
    EXIT_MISSING: "the run, step or tensor does not exist",
    EXIT_DAMAGED: "the store is damaged or in a format this version cannot read",
    EXIT_LOCKED: "the run is locked by a writer",
    EXIT_IO: "a file cannot be read or written (permissions, read-only file system, disk full), "
             "or the output's reader went away",
    EXIT_BUG: "an unexpected error inside datastates-hist (please report it)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}


def add_command(sub, name: str, help: str, **kwargs):
    """A command's parser, its ``--help`` opening with what the list of commands says of it."""
    kwargs.setdefault("description", help[0].upper() + help[1:] + ".")
    return sub.add_parser(name, help=help, **kwargs)


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def step_number(text: str) -> int:
    """A step given on the command line: a whole number the index can hold."""
    from ..layout import MAX_STEP

    # digits only: int() would also take "1_0", "-0", " 5" and digits of other scripts
    step = int(text) if _digits(text) else -1
    if not 0 <= step <= MAX_STEP:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step (a whole number from 0 to 2**63-1)")
    return step


def step_choice(text: str) -> int:
    """A step to read, given on the command line: a committed step, or ``latest``
    or a negative number counting back from the newest (-1 the newest, -2 the one
    before). Negative steps are resolved against the run by :func:`resolve_step`."""
    if text == "latest":
        return -1
    back = text.removeprefix("-")
    if back != text and _digits(back) and int(back) > 0:
        return -int(back)
    try:
        return step_number(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step (a whole number from 0 to 2**63-1, latest, "
                                         "or -N for the Nth newest)") from None


def count(text: str) -> int:
    """A count given on the command line: a whole number from 1."""
    n = int(text) if _digits(text) else 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (a whole number from 1)")
    return n


STEP_HELP = "a committed step; latest or -1 for the newest, -2 for the one before"


def resolve_step(store, step: int) -> int:
    """The committed step that ``step`` (from :func:`step_choice`) names in ``store``."""
    if step < 0:
        steps = store.steps()
        if not steps:
            store.latest()  # raises StepNotFoundError: the run has no committed steps
        if -step > len(steps):
            store.row(step)  # raises StepNotFoundError, naming the committed steps
        step = steps[step]
    return step


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="datastates-hist",
        description="Look at, check and manage a datastates-hist training history.",
        epilog="exit codes: " + "; ".join(f"{code} {what}" for code, what in EXIT_CODES.items()),
    )
    p.add_argument("--version", action="version", version=f"datastates-hist {datastates_hist.__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"{__name__}.{name}")
        cmd = module.add_parser(sub)
        cmd.set_defaults(handler=module.run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code = args.handler(args)
        sys.stdout.flush()  # a failed write of the output is an error of the command too
        return code
    except BaseException as exc:
        code, message = outcome(exc)
        if code is None:
            raise  # SystemExit and the like: theirs to end with
        if message:
            print(f"datastates-hist: {message}", file=sys.stderr)
        return code


def outcome(exc: BaseException) -> tuple[int | None, str]:
    """The exit code and the one-line message for an error that ended a command."""
    if isinstance(exc, KeyError):
        return EXIT_MISSING, str(exc.args[0]) if exc.args else "not found"
    if isinstance(exc, (StoreNotFoundError, StepNotFoundError)):
        return EXIT_MISSING, str(exc)
    if isinstance(exc, (CorruptionError, FormatError)):
        return EXIT_DAMAGED, str(exc)
    if isinstance(exc, StoreLockedError):
        return EXIT_LOCKED, str(exc)
    if isinstance(exc, BrokenPipeError):  # the reader of the output went away (| head)
        _silence_stdout()
        return EXIT_IO, ""
    if isinstance(exc, (OSError, sqlite3.Error, CheckpointError)):
        return EXIT_IO, os_error_message(exc)
    if isinstance(exc, (ValueError, ImportError)):
        return EXIT_USAGE, str(exc)
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted"
    if isinstance(exc, Exception):
        return EXIT_BUG, (f"unexpected error, please report it: {type(exc).__name__}: {exc}")
    return None, ""


def os_error_message(exc: BaseException) -> str:
    """``strerror: path`` for an OSError of the system (its own text otherwise)."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename and type(exc).__str__ is OSError.__str__:
        return f"{exc.strerror}: {exc.filename}"
    return str(exc)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that flushing it at exit does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
