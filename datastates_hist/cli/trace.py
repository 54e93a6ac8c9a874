"""``datastates-hist trace RUN NAME...``: scalars and one statistic of tensors over every step.

Each NAME is a tensor (``model/`` may be left out), a scalar written with the
steps (``loss`` for ``extra/data/loss``, ``optim/param_groups/0/lr``) or a glob
of either; every series is shown over the same steps. Read from the index: no
tensor data is read. Printed as a table and a sparkline per series;
``--plot FILE.png`` writes a matplotlib figure (one panel per scalar, one for
the tensors, sharing the step axis). ``--stat update_ratio`` is each step's
relative update ||x - x_base|| / ||x_base|| against the step its delta is
encoded against (blank at key steps); it spans decades, so its sparkline and
plot use a log scale.
"""

from __future__ import annotations

import math
import os
import sys
from collections import Counter

from ..index import TENSOR_STATS
from . import add_command
from .output import GAP, add_json_flag, console, emit, num, shorten_names

BARS = "▁▂▃▄▅▆▇█"
LOG_SCALE_STATS = ("update_ratio",)
MIN_SPARK = 8  # bars a sparkline keeps beside however long a label (the line wraps then)
LEAST_LABEL = 8  # characters a label keeps in a narrow terminal: a header cannot wrap
LEGEND_MAX = 10  # tensors a plot's legend names; more would hide the panels
AXIS_LABELS = {"update_ratio": "update ratio  ‖x − x_base‖ / ‖x_base‖"}


def add_parser(sub):
    cmd = add_command(sub, "trace", help="scalars (a loss) and one statistic of tensors over all steps")
    cmd.add_argument("run", help="the run directory")
    cmd.add_argument("names", nargs="+", metavar="NAME",
                     help="tensor names ('model/' may be left out), scalar names ('loss', "
                          "'optim/param_groups/0/lr') or globs of either ('blocks.0.*')")
    cmd.add_argument("--stat", choices=TENSOR_STATS, default="norm", metavar="STAT",
                     help=f"the statistic of tensors: {', '.join(TENSOR_STATS)} (default norm); "
                          "update_ratio: ||x - x_base|| / ||x_base|| of the steps stored as a delta against "
                          "x_base (the step before when every step is kept), blank at key steps")
    cmd.add_argument("--plot", metavar="FILE", help="also write a matplotlib figure (PNG, PDF, SVG)")
    add_json_flag(cmd)
    return cmd


def sparkline(values: list[float], log: bool = False, width: int | None = None) -> str:
    """One bar per value, scaled from the smallest to the largest finite value (their
    logarithms with ``log``, where values not above 0 get the lowest bar); blank for none.
    More values than ``width``: one bar per run of consecutive values, their mean."""
    if log:
        positive = [v for v in values if v is not None and math.isfinite(v) and v > 0]
        floor = min(positive, default=1.0)
        values = [v if v is None or not math.isfinite(v) else math.log10(max(v, floor)) for v in values]
    if width is not None and len(values) > width > 0:
        runs = [values[i * len(values) // width:(i + 1) * len(values) // width] for i in range(width)]
        values = [sum(f) / len(f) if (f := [v for v in r if v is not None and math.isfinite(v)]) else None
                  for r in runs]
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    span = hi - lo or 1.0
    return "".join(" " if v is None or not math.isfinite(v) else
                   BARS[min(len(BARS) - 1, int((v - lo) / span * len(BARS)))] for v in values)


def run(args) -> int:
    from ..history import History  # torch: imported only when a command needs it

    plot_path = args.plot and plot_target(args.plot)
    with History(args.run) as h:
        df = h.trace(args.names, args.stat)
    tensors = set(df.attrs["tensors"])
    label = labels(df.columns, tensors)
    steps = [int(s) for s in df.index]
    series = {name: [None if v is None or v != v else float(v) for v in df[name]]  # NULL/NaN: blank
              for name in df.columns}
    if plot_path:
        plot(steps, series, tensors, args.stat, plot_path, label)
        unnamed = f" ({len(tensors)} tensors: too many to name in a legend)" if len(tensors) > LEGEND_MAX else ""
        print(f"wrote {plot_path}{unnamed}", file=sys.stderr)  # stdout holds the table, or the JSON
    data = {"stat": args.stat, "steps": steps, "series": series}
    if len(series) == 1:  # one series: its name and values at the top level too
        (name, values), = series.items()
        data.update(name=name, values=values)
    suffix = {n: f" {args.stat}" if n in tensors else "" for n in series}
    if not args.json:
        out = console()
        # a label never wraps: beside the step column in the table, and beside a sparkline
        room = min(out.width - GAP - max(map(len, ["step", *map(str, steps)])), out.width - 2 - MIN_SPARK)
        label = fitted_labels(label, {n: room - len(suffix[n]) for n in series})
    columns = [label[n] + suffix[n] for n in series]
    rows = [[str(s), *(num(values[i]) for values in series.values())] for i, s in enumerate(steps)]
    emit(args, ["step", *columns], rows, data, left=(), names=None, split=True)
    if not args.json:
        from rich.cells import cell_len

        for column, (name, values) in zip(columns, series.items()):
            log = name in tensors and args.stat in LOG_SCALE_STATS
            room = max(out.width - cell_len(column) - 2, MIN_SPARK)
            out.print(f"{column}: {sparkline(values, log, room)}", markup=False, highlight=False)
    return 0


def labels(names, tensors: set[str]) -> dict[str, str]:
    """How each series is named on screen: a tensor as in ``state_dict()``, a scalar by
    its shortest form (``loss`` for ``extra/data/loss``); by its stored name where two
    would read the same. The JSON keeps the stored names."""
    from ..items import short_name
    from ..scalars import short_forms

    label = {n: short_name(n) if n in tensors else min(short_forms(n) or [n], key=len) for n in names}
    while len(set(label.values())) < len(label):  # stored names are distinct: this ends
        taken = Counter(label.values())
        label = {n: s if taken[s] == 1 else n for n, s in label.items()}
    return label


def fitted_labels(label: dict[str, str], room: dict[str, int]) -> dict[str, str]:
    """Each label in its ``room`` (:func:`.output.shorten_names`), unless two would then
    read the same: then as they are (they wrap)."""
    names = list(label)
    short = dict(zip(names, shorten_names([label[n] for n in names], [room[n] for n in names], strip=False,
                                          least=LEAST_LABEL)))
    return short if len(set(short.values())) == len(short) else label


def plot_target(path: str) -> str:
    """The file ``--plot PATH`` writes: PATH, or PATH.png without a suffix (as
    matplotlib names it); refused when it is a folder or has no folder to go in."""
    if os.path.isdir(path):
        raise ValueError(f"cannot write the plot to {path}: it is a folder; name a file (.png, .pdf, .svg)")
    if not os.path.splitext(path)[1]:
        path += ".png"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write the plot to {path}: there is no folder {folder}")
    return path


def plot(steps, series: dict[str, list], tensors: set[str], stat: str, path: str, label: dict[str, str]) -> None:
    """One panel per scalar and one for every tensor's ``stat``, sharing the step axis
    (the tensors' on a log scale for a stat of :data:`LOG_SCALE_STATS`); each series
    named by ``label``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    scalars = [n for n in series if n not in tensors]
    panels = [[n] for n in scalars] + ([[n for n in series if n in tensors]] if tensors else [])
    legend = 1 < len(tensors) <= LEGEND_MAX  # names the tensors' lines, right of the panels so that it hides none
    width = 7 + (0.07 * max(len(label[n]) for n in tensors) + 0.6 if legend else 0)
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False, figsize=(width, 1.2 + 2.3 * len(panels)))
    for ax, names in zip(axes[:, 0], panels):
        log = names[0] in tensors and stat in LOG_SCALE_STATS
        for name in names:
            # a log axis cannot show 0 (a tensor that did not change): left out, like a missing value
            ys = [math.nan if v is None or (log and v <= 0) else v for v in series[name]]
            ax.plot(steps, ys, marker=".", label=label[name])
        if names[0] in tensors:
            ax.set_ylabel(AXIS_LABELS.get(stat, stat))
            title = label[names[0]] if len(names) == 1 else f"{stat} of {len(names)} tensors"
            ax.set_title(f"{title}{' (log scale)' if log else ''}", fontsize="medium")
            if log:
                ax.set_yscale("log")
            if legend:
                ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
        else:
            ax.set_ylabel(label[names[0]])
        ax.grid(alpha=0.3, which="both" if log else "major")
    axes[-1, 0].set_xlabel("step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
