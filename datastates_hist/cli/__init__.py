"""The ``datastates-hist`` command line: look at, check and manage a run's history.

Each command is a module of this package with ``add_parser(subparsers)`` and
``run(args) -> int``. Exit codes: 0 success, 1 a check failed (``verify``),
2 bad usage, 3 missing run, step or tensor, 4 damaged or unreadable store,
5 the run is locked by a writer.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import (
    CorruptionError, FormatError, StepNotFoundError, StoreLockedError, StoreNotFoundError,
)

COMMANDS = ("ls", "show", "diff", "trace", "export", "prune", "verify", "repair")

EXIT_FAILED, EXIT_USAGE, EXIT_MISSING, EXIT_DAMAGED, EXIT_LOCKED = 1, 2, 3, 4, 5


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="datastates-hist",
        description="Look at, check and manage a datastates-hist training history.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"{__name__}.{name}")
        cmd = module.add_parser(sub)
        cmd.set_defaults(handler=module.run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.handler(args)
    except (StoreNotFoundError, StepNotFoundError, KeyError) as exc:
        print(f"datastates-hist: {exc.args[0] if isinstance(exc, KeyError) else exc}", file=sys.stderr)
        return EXIT_MISSING
    except (CorruptionError, FormatError) as exc:
        print(f"datastates-hist: {exc}", file=sys.stderr)
        return EXIT_DAMAGED
    except StoreLockedError as exc:
        print(f"datastates-hist: {exc}", file=sys.stderr)
        return EXIT_LOCKED
    except ValueError as exc:
        print(f"datastates-hist: {exc}", file=sys.stderr)
        return EXIT_USAGE
