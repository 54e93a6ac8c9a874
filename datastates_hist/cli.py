"""The ``datastates-hist`` command line: look at a run's history.

Commands: ``ls RUN`` (committed steps) and ``show RUN STEP`` (tensors of a
step, with statistics from the index). ``--json`` prints machine-readable
output. Exit codes: 0 success, 2 bad usage, 3 missing run/step, 4 damaged store.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

from .errors import CorruptionError, FormatError, StepNotFoundError, StoreNotFoundError
from .store import Store


def _ls(store: Store, args) -> tuple[list[str], list[list], list[dict]]:
    rows = store.index.step_rows()
    data = [{"step": r.step, "time": r.time, "bytes": r.nbytes, "tensors": r.ntensors,
             "backend": r.backend, "location": r.location} for r in rows]
    table = [[str(r.step), _when(r.time), _size(r.nbytes), str(r.ntensors), r.backend] for r in rows]
    return ["step", "time", "bytes", "tensors", "backend"], table, data


def _show(store: Store, args) -> tuple[list[str], list[list], list[dict]]:
    records = store.records(args.step)
    data = [{"name": r.name, "shape": list(r.shape), "dtype": r.dtype, "nbytes": r.nbytes,
             "checksum": r.checksum, **r.stats} for r in records]
    table = [[r.name, "x".join(map(str, r.shape)) or "()", r.dtype, _num(r.stats.get("norm")),
              _num(r.stats.get("min")), _num(r.stats.get("max"))] for r in records]
    return ["name", "shape", "dtype", "norm", "min", "max"], table, data


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _num(x) -> str:
    return "" if x is None else f"{x:.6g}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="datastates-hist", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list the committed steps of a run")
    ls.add_argument("run", help="the run directory")
    ls.set_defaults(fn=_ls)
    show = sub.add_parser("show", help="list the tensors of one step")
    show.add_argument("run", help="the run directory")
    show.add_argument("step", type=int, help="a committed step")
    show.set_defaults(fn=_show)
    for cmd in (ls, show):
        cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        store = Store(args.run)
        try:
            columns, table, data = args.fn(store, args)
        finally:
            store.close()
    except (StoreNotFoundError, StepNotFoundError) as exc:
        print(f"datastates-hist: {exc}", file=sys.stderr)
        return 3
    except (CorruptionError, FormatError) as exc:
        print(f"datastates-hist: {exc}", file=sys.stderr)
        return 4
    if args.json:
        json.dump(data, sys.stdout, indent=1)
        print()
        return 0
    from rich.console import Console
    from rich.table import Table

    out = Table(show_edge=False, box=None, header_style="bold")
    for i, col in enumerate(columns):
        left = i == 0 or col in ("name", "dtype", "time", "backend")
        out.add_column(col, justify="left" if left else "right", overflow="fold")
    for row in table:
        out.add_row(*row)
    # names are long: never cut them when the output goes to a file or a pipe
    Console(width=None if sys.stdout.isatty() else 240).print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
