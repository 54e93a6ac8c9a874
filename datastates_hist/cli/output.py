"""How commands print: aligned tables in a terminal (rich), JSON with ``--json``."""

from __future__ import annotations

import datetime
import errno
import json
import sys
from typing import Any


def add_json_flag(cmd) -> None:
    cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")


def emit(args, columns: list[str], rows: list[list[str]], data: Any, left=("name",)) -> None:
    """Print ``data`` as JSON when ``--json`` was given, else ``rows`` as a table."""
    if getattr(args, "json", False):
        json.dump(data, sys.stdout, indent=1, default=_jsonable)
        print()
        return
    from rich.table import Table

    table = Table(show_edge=False, box=None, header_style="bold")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 or col in left else "right", overflow="fold")
    for row in rows:
        table.add_row(*row)
    console().print(table)


_CONSOLE: list = []


def console():
    """One rich console; names are long, so output to a file or a pipe is never cut."""
    if not _CONSOLE:
        from rich.console import Console

        class QuietOnBrokenPipe(Console):
            def on_broken_pipe(self) -> None:  # rich would exit 1, the code of a failed check
                self.quiet = True
                raise BrokenPipeError(errno.EPIPE, "the reader of the output went away")

        _CONSOLE.append(QuietOnBrokenPipe(width=None if sys.stdout.isatty() else 240))
    return _CONSOLE[0]


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"cannot print {type(x).__name__} as JSON")


def when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def num(x) -> str:
    return "" if x is None else f"{x:.6g}"
