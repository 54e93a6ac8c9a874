"""How commands print: aligned tables in a terminal (rich), JSON with ``--json``."""

from __future__ import annotations

import datetime
import errno
import json
import math
import os
import sys
from typing import Any


def add_json_flag(cmd) -> None:
    cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")


def emit(args, columns: list[str], rows: list[list[Any]], data: Any, left=("name",), wrap: str | None = None,
         names: str | None = "name", split: bool = False, gives_way: tuple[str, ...] = ()) -> None:
    """Print ``data`` as JSON when ``--json`` was given, else ``rows`` as a table.

    A cell is a string, or a number (None and NaN print blank) printed with 6
    significant digits, or fewer where that lets the table fit the console. Column
    ``names`` does not wrap: a name too long for the room the other columns leave is
    shortened (see :func:`shorten_names`); where that would make two names read the
    same, the columns of ``gives_way`` are left out, in that order, until the names
    stay apart (stderr says which). Column ``wrap`` (free text, the last) wraps
    instead, in the room the others leave, at least :data:`WRAP_ROOM`. ``split``: a
    table of many columns (series) too wide for the console is printed as several,
    each with the first column (the steps) and as many of the others as fit.
    """
    if getattr(args, "json", False):
        json.dump(finite(data), sys.stdout, indent=1, default=_jsonable)
        print()
        return
    out = console()
    shown, cells, by_column, need = layout(columns, rows, [], out.width, wrap)
    left_out: list[str] = []
    if need > out.width and split:
        for n, part in enumerate(column_parts(by_column, out.width)):
            if n:
                out.print()
            out.print(table([shown[i] for i in part], [[row[i] for i in part] for row in cells], left, wrap))
        return
    if need > out.width and names in columns:
        left_out, shown, cells = fit_names(columns, rows, names, gives_way, out.width, wrap)
    out.print(table(shown, cells, left, wrap))
    if left_out:
        print(f"({', '.join(left_out)} left out to fit {out.width} columns; --json has every column)",
              file=sys.stderr)


def fit_names(columns: list[str], rows: list[list[Any]], names: str, gives_way: tuple[str, ...], width: int,
              wrap: str | None) -> tuple[list[str], list[str], list[list[str]]]:
    """(columns left out, columns shown, cells) of a table too wide for ``width``, its
    column ``names`` shortened: the fewest of ``gives_way`` left out that give the names
    :data:`MIN_NAME_ROOM` and keep them apart; else the fewest that give them the room."""
    tried = []
    for k in range(len(gives_way) + 1):
        left_out = list(gives_way[:k])
        shown, cells, by_column, need = layout(columns, rows, left_out, width, wrap)
        at = shown.index(names)
        full = [row[at] for row in cells]
        room = width - (need - width_of(by_column[at]))
        short = shorten_names(full, room) if need > width else full
        choice = (left_out, shown, [[*row[:at], name, *row[at + 1:]] for row, name in zip(cells, short)])
        roomy = need <= width or room >= MIN_NAME_ROOM
        if roomy and len(set(short)) == len(set(full)):
            return choice
        tried.append((roomy, choice))
    return next((choice for roomy, choice in tried if roomy), tried[-1][1])


def layout(columns: list[str], rows: list[list[Any]], left_out: list[str], width: int, wrap: str | None):
    """The columns shown (those not ``left_out``) and what :func:`fitted` makes of them."""
    keep = [i for i, c in enumerate(columns) if c not in left_out]
    return ([columns[i] for i in keep],
            *fitted([columns[i] for i in keep], [[row[i] for i in keep] for row in rows], width, wrap))


def fitted(columns: list[str], rows: list[list[Any]], width: int, wrap: str | None):
    """The cells of ``rows`` as text, with the most significant digits (6, 4, 3) that
    fit ``width``; the cells by column; the width they need."""
    for digits in (6, 4, 3):
        cells = [[cell if isinstance(cell, str) else num(cell, digits) for cell in row] for row in rows]
        by_column = [list(column) for column in zip(columns, *cells)]
        need = sum(width_of(c) + GAP for i, c in enumerate(by_column) if columns[i] != wrap) - GAP
        if wrap in columns:
            need += GAP + min(width_of(by_column[columns.index(wrap)]), WRAP_ROOM)
        if need <= width:
            break
    return cells, by_column, need


def width_of(cells: list[str]) -> int:
    from rich.cells import cell_len

    return max(map(cell_len, cells))


def column_parts(by_column: list[list[str]], width: int) -> list[list[int]]:
    """The columns of a table too wide for ``width``, in groups that fit beside the
    first (each at least one column, however wide)."""
    first = width_of(by_column[0])
    parts, part, used = [], [0], first
    for i, cells in enumerate(by_column[1:], 1):
        if len(part) > 1 and used + GAP + width_of(cells) > width:
            parts.append(part)
            part, used = [0], first
        part.append(i)
        used += GAP + width_of(cells)
    return [*parts, part]


def finite(data: Any) -> Any:
    """``data`` with NaN and the infinities as None: JSON has no such numbers, and
    ``json.dump`` would write tokens that JSON readers refuse."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite(v) for v in data]
    return data


def table(columns: list[str], cells: list[list[str]], left, wrap: str | None = None):
    from rich.table import Table
    from rich.text import Text

    # no edge padding: two spaces between columns and none around them leave the names more room
    grid = Table(show_edge=False, box=None, header_style="bold", pad_edge=False, padding=(0, GAP // 2))
    for i, col in enumerate(columns):
        grid.add_column(Text(col), justify="left" if i == 0 or col in left else "right",
                        no_wrap=(i > 0 or col == "step") and col != wrap,  # a step number never wraps
                        overflow="fold")
    for row in cells:
        grid.add_row(*map(Text, row))  # as written: a '[' in a name is not rich markup
    return grid


GAP = 2  # spaces between the columns of a table: a cell's padding on either side
WRAP_ROOM = 24  # the least room for a column of free text that wraps
MIN_NAME_ROOM = 16  # a name shortened further says too little: it wraps instead
KEPT_END = 32  # characters of a name's end kept before its group is given up
CUT_REACH = 8  # characters (and a quarter of what is kept) a shortened name gives up more to begin at a part


def shorten_names(names: list[str], room: int | list[int], strip: bool = True, least: int | None = None) -> list[str]:
    """A column of tensor names in at most ``room`` characters each (or each its own
    room): the model's without ``model/`` (as in ``state_dict()``, and as every command
    takes them; unless not ``strip``), then each too long :func:`shorten`-ed (to no
    fewer than ``least`` characters: :data:`MIN_NAME_ROOM` unless given)."""
    from ..items import short_name

    rooms = room if isinstance(room, list) else [room] * len(names)
    if strip:
        names = [short_name(n) for n in names]
    least = MIN_NAME_ROOM if least is None else least
    short = [shorten(n, r, least=least) for n, r in zip(names, rooms)]
    if len(set(short)) < len(set(names)):  # a cut at a part's start lost what told two apart
        short = [shorten(n, r, at_part=False, least=least) for n, r in zip(names, rooms)]
    if len(set(short)) < len(set(names)):  # alike to their ends: their starts tell them apart
        short = [shorten(n, r, at_part=False, keep_start=True, least=least) for n, r in zip(names, rooms)]
    return short


def shorten(name: str, room: int, at_part: bool = True, keep_start: bool = False,
            least: int = MIN_NAME_ROOM) -> str:
    """``name`` in at most ``room`` characters, an ellipsis in place of what is left
    out. The end is kept first: it holds what tells tensors apart (block number,
    parameter, optimizer state), from the start of one of its parts where one is near;
    the group (``optim/``) when there is room for it too. ``keep_start``: a third of
    the room for the name's start, the rest for its end (names alike to their ends);
    ``least``: the fewest characters it keeps, whatever the room."""
    room = max(room, least, 2)
    if len(name) <= room:
        return name
    if keep_start:
        start = room // 3
        return name[:start] + "…" + name[len(name) - (room - start - 1):]
    group = name[:name.find("/") + 1]
    head = group if room - len(group) - 1 >= KEPT_END else ""
    start = len(name) - (room - len(head) - 1)
    # from the start of a part of the name (after a '/' or '.') when one is near: 'state/...', not 'm/state/...'
    reach = min(CUT_REACH, (len(name) - start) // 4) if at_part else 0
    cut = next((i + 1 for i in range(start - 1, start + reach) if name[i] in "/."), start)
    return head + "…" + name[cut:]


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
    if hasattr(x, "tolist"):  # numpy's scalars and arrays: NaN in them too is None
        return finite(x.tolist())
    raise TypeError(f"cannot print {type(x).__name__} as JSON")


def plural(noun: str, n: int) -> str:
    """``noun``, plural unless ``n`` is 1 (``step``, ``steps``)."""
    return noun if n == 1 else f"{noun}s"


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1 (``1 step``, ``3 steps``)."""
    return f"{n} {plural(noun, n)}"


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
