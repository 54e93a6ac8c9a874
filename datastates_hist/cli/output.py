"""How commands print: aligned tables in a terminal (rich), JSON with ``--json``."""

from __future__ import annotations

import datetime
import errno
import json
import os
import sys
from typing import Any


def add_json_flag(cmd) -> None:
    cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")


def emit(args, columns: list[str], rows: list[list[Any]], data: Any, left=("name",), wrap: str | None = None) -> None:
    """Print ``data`` as JSON when ``--json`` was given, else ``rows`` as a table.

    A cell is a string, or a number (None and NaN print blank) printed with 6
    significant digits, or fewer where that lets the table fit the console. The
    first column (the names) does not wrap: a name too long for the room the other
    columns leave is shortened (see :func:`shorten`). Column ``wrap`` (free text, the
    last) wraps instead, in the room the others leave unshortened.
    """
    if getattr(args, "json", False):
        json.dump(data, sys.stdout, indent=1, default=_jsonable)
        print()
        return
    out = console()
    for digits in (6, 4, 3):
        cells = [[cell if isinstance(cell, str) else num(cell, digits) for cell in row] for row in rows]
        by_column = [list(column) for column in zip(columns, *cells)]
        if table_width(by_column) <= out.width or wrap is not None:
            break
    else:
        room = out.width - table_width(by_column[1:]) - GAP
        cells = [[shorten(row[0], room), *row[1:]] for row in cells]
    out.print(table(columns, cells, left, wrap))


def table(columns: list[str], cells: list[list[str]], left, wrap: str | None = None):
    from rich.table import Table
    from rich.text import Text

    # no edge padding: two spaces between columns and none around them leave the names more room
    grid = Table(show_edge=False, box=None, header_style="bold", pad_edge=False, padding=(0, GAP // 2))
    for i, col in enumerate(columns):
        grid.add_column(col, justify="left" if i == 0 or col in left else "right", no_wrap=i > 0 and col != wrap,
                        overflow="fold")
    for row in cells:
        grid.add_row(*map(Text, row))  # as written: a '[' in a name is not rich markup
    return grid


def table_width(cells_by_column: list[list[str]]) -> int:
    """How wide :func:`table` prints columns of these cells (headers included) unwrapped."""
    from rich.cells import cell_len

    return sum(max(map(cell_len, cells)) for cells in cells_by_column) + GAP * (len(cells_by_column) - 1)


GAP = 2  # spaces between the columns of a table: a cell's padding on either side
MIN_NAME_ROOM = 16  # a name shortened further says too little: it wraps instead
KEPT_END = 24  # characters of a name's end kept before its group is given up


def shorten(name: str, room: int) -> str:
    """``name`` in at most ``room`` characters, an ellipsis in place of what is left
    out. The end is kept first: it holds what tells tensors apart (block number,
    parameter, optimizer state); the group (``model/``, ``optim/``) when there is
    room for it too."""
    room = max(room, MIN_NAME_ROOM)
    if len(name) <= room:
        return name
    group = name[:name.find("/") + 1]
    head = group if room - len(group) - 1 >= KEPT_END else ""
    return head + "…" + name[len(name) - (room - len(head) - 1):]


def console():
    """A rich console as wide as the terminal (or $COLUMNS); names are long, so output
    to a file or a pipe is never cut."""
    from rich.console import Console

    class QuietOnBrokenPipe(Console):
        def on_broken_pipe(self) -> None:  # rich would exit 1, the code of a failed check
            self.quiet = True
            raise BrokenPipeError(errno.EPIPE, "the reader of the output went away")

    sized = sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit()
    return QuietOnBrokenPipe(width=None if sized else 240)


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


def num(x, digits: int = 6) -> str:
    """A number with ``digits`` significant digits; None and NaN blank."""
    if x is None or x != x:
        return ""
    text = f"{x:.{digits}g}"
    if "e" in text:  # 1.5e-05 -> 1.5e-5: narrower columns
        mantissa, exponent = text.split("e")
        text = f"{mantissa}e{int(exponent)}"
    return text
