"""``datastates-hist trace RUN TENSOR``: one statistic of one tensor over every step.

Read from the index: no tensor data is read. Printed as a table and a sparkline;
``--plot FILE.png`` writes a matplotlib figure.
"""

from __future__ import annotations

import math

from ..history import History
from ..index import STAT_KEYS
from .output import add_json_flag, console, emit, num

BARS = "▁▂▃▄▅▆▇█"


def add_parser(sub):
    cmd = sub.add_parser("trace", help="one statistic of one tensor over all steps")
    cmd.add_argument("run", help="the run directory")
    cmd.add_argument("tensor", help="a tensor name ('model/' may be left out)")
    cmd.add_argument("--stat", choices=STAT_KEYS, default="norm", help="the statistic (default norm)")
    cmd.add_argument("--plot", metavar="FILE", help="also write a matplotlib figure (PNG, PDF, SVG)")
    add_json_flag(cmd)
    return cmd


def sparkline(values: list[float]) -> str:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    span = hi - lo or 1.0
    return "".join(" " if v is None or not math.isfinite(v) else
                   BARS[min(len(BARS) - 1, int((v - lo) / span * len(BARS)))] for v in values)


def run(args) -> int:
    with History(args.run) as h:
        df = h.stats(args.tensor)
    name = df.attrs["name"]
    values = [None if v is None or v != v else float(v) for v in df[args.stat]]  # NULL/NaN: blank
    steps = [int(s) for s in df.index]
    if args.plot:
        plot(steps, values, name, args.stat, args.plot)
    data = {"name": name, "stat": args.stat, "steps": steps, "values": values}
    emit(args, ["step", args.stat], [[str(s), num(v)] for s, v in zip(steps, values)], data, left=())
    if not args.json:
        console().print(f"{name} {args.stat}: {sparkline(values)}")
    return 0


def plot(steps, values, name, stat, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, [math.nan if v is None else v for v in values], marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel(stat)
    ax.set_title(name)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
