"""``datastates-hist trace RUN NAME...``: scalars and one statistic of tensors over every step.

Each NAME is a tensor (``model/`` may be left out), a scalar written with the
steps (``loss`` for ``extra/data/loss``, ``optim/param_groups/0/lr``) or a glob
of either; every series is shown over the same steps. Read from the index: no
tensor data is read. Printed as a table and a sparkline per series;
``--plot FILE.png`` writes a matplotlib figure (one panel per scalar, one for
the tensors, sharing the step axis).
"""

from __future__ import annotations

import math

from ..index import STAT_KEYS
from .output import add_json_flag, console, emit, num

BARS = "▁▂▃▄▅▆▇█"


def add_parser(sub):
    cmd = sub.add_parser("trace", help="scalars (loss, lr) and one statistic of tensors over all steps")
    cmd.add_argument("run", help="the run directory")
    cmd.add_argument("names", nargs="+", metavar="NAME",
                     help="tensor names ('model/' may be left out), scalar names ('loss', "
                          "'optim/param_groups/0/lr') or globs of either ('blocks.0.*')")
    cmd.add_argument("--stat", choices=STAT_KEYS, default="norm", help="the statistic of tensors (default norm)")
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
    from ..history import History  # torch: imported only when a command needs it
    from ..items import short_name

    with History(args.run) as h:
        df = h.trace(args.names, args.stat)
    tensors = set(df.attrs["tensors"])
    steps = [int(s) for s in df.index]
    series = {name: [None if v is None or v != v else float(v) for v in df[name]]  # NULL/NaN: blank
              for name in df.columns}
    if args.plot:
        plot(steps, series, tensors, args.stat, args.plot)
    data = {"stat": args.stat, "steps": steps, "series": series}
    if len(series) == 1:  # one series: its name and values at the top level too
        (name, values), = series.items()
        data.update(name=name, values=values)
        columns = [args.stat if name in tensors else "value"]
    else:
        columns = [short_name(n) + (f" {args.stat}" if n in tensors else "") for n in series]
    rows = [[str(s), *(num(values[i]) for values in series.values())] for i, s in enumerate(steps)]
    emit(args, ["step", *columns], rows, data, left=())
    if not args.json:
        for name, values in series.items():
            console().print(f"{name}{' ' + args.stat if name in tensors else ''}: {sparkline(values)}")
    return 0


def plot(steps, series: dict[str, list], tensors: set[str], stat: str, path: str) -> None:
    """One panel per scalar and one for every tensor's ``stat``, sharing the step axis."""
    from ..items import short_name

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    scalars = [n for n in series if n not in tensors]
    panels = [[n] for n in scalars] + ([[n for n in series if n in tensors]] if tensors else [])
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False, figsize=(7, 1.2 + 2.3 * len(panels)))
    for ax, names in zip(axes[:, 0], panels):
        for name in names:
            ax.plot(steps, [math.nan if v is None else v for v in series[name]], marker=".", label=short_name(name))
        ax.set_ylabel(stat if names[0] in tensors else short_name(names[0]))
        if names[0] in tensors:
            title = short_name(names[0]) if len(names) == 1 else f"{stat} of {len(names)} tensors"
            ax.set_title(title, fontsize="medium")
            if 1 < len(names) <= 10:
                ax.legend(fontsize="small", loc="best")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
