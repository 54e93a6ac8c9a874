"""``datastates-hist diff``: how tensors changed between two steps, of one run or two runs.

    datastates-hist diff RUN A B [--names GLOB] [--top N] [--sort METRIC] [--all]
    datastates-hist diff RUN_A:STEP RUN_B:STEP

Tensors are ranked by group, most changed first within each: the model's
tensors (``model/``) first, then those of other objects (``extra/``), then the
optimizer's state (``optim/``). An optimizer's moments change relatively more
than the weights they move, by design, and would otherwise fill the top of the
table; so ``--top N`` lists the model's most changed tensors, and
``--names 'optim/*'`` ranks the optimizer's state alone. Tensors of whole
numbers only (an optimizer's ``step`` counters, BatchNorm's
``num_batches_tracked``, masks) change by design and say nothing of how the
model moves: they are left out unless ``--names`` or ``--all`` asks for them.
A tensor that was all zeros at A has no relative change (``rel_l2`` blank) and
is ranked last of its group by it.
"""

from __future__ import annotations

import math
import os
import sys
from argparse import ArgumentTypeError

from ..items import under
from . import add_command, count, resolve_step, step_choice
from .output import add_json_flag, counted, emit

METRICS = ("l2", "rel_l2", "max_abs", "cosine", "frac_changed")
# how each metric puts the most changed first: cosine is 1 for an unchanged direction
MOST_CHANGED_FIRST = {"l2": -1, "rel_l2": -1, "max_abs": -1, "cosine": 1, "frac_changed": -1}
# the groups of tensors in the order they are listed; tensors of no group come last
GROUPS = ("model", "extra", "optim")


def add_parser(sub):
    cmd = add_command(sub, "diff", help="compare the tensors of two steps",
                      # argparse would show the targets as repeatable: two steps, one comparison
                      usage="%(prog)s [-h] [--names GLOB] [--top N] [--sort METRIC]\n"
                            "       [--all] [--json] (RUN A B | RUN_A:STEP RUN_B:STEP)",
                      description="Compare RUN at steps A and B, or RUN_A:STEP with RUN_B:STEP. "
                                  "A step is a number, latest, or -1 for the newest, -2 for the one before.")
    cmd.add_argument("targets", nargs="+", metavar="RUN A B | RUN_A:STEP RUN_B:STEP")
    cmd.add_argument("--names", action="append", metavar="GLOB",
                     help="only tensors matching GLOB ('model/' may be left out); repeatable")
    cmd.add_argument("--top", type=count, metavar="N",
                     help="only the first N rows (the model's most changed tensors come first)")
    cmd.add_argument("--sort", choices=METRICS, default="rel_l2",
                     help="rank by this metric, most changed first (largest first, cosine smallest "
                          "first), within each group: model/, then extra/, then optim/ (default rel_l2)")
    cmd.add_argument("--all", action="store_true",
                     help="also tensors of whole numbers only (step counters, masks), "
                          "left out unless --names selects them")
    add_json_flag(cmd)
    return cmd


def parse_targets(targets: list[str]) -> tuple[str, int, str, int]:
    """``RUN A B`` or ``RUN_A:STEP RUN_B:STEP`` -> (run_a, step_a, run_b, step_b);
    steps as :func:`step_choice` gives them (negative: counted from the newest)."""
    try:
        if len(targets) == 3:
            return targets[0], step_choice(targets[1]), targets[0], step_choice(targets[2])
        if len(targets) == 2 and all(":" in t for t in targets):
            (ra, sa), (rb, sb) = (t.rsplit(":", 1) for t in targets)
            return ra, step_choice(sa), rb, step_choice(sb)
    except ArgumentTypeError as exc:
        raise ValueError(f"diff: {exc}") from None
    raise ValueError(f"diff takes RUN A B or RUN_A:STEP RUN_B:STEP, got {' '.join(targets)}")


def group_of(name: str) -> int:
    """The place of the group of tensor ``name`` in :data:`GROUPS` (``len(GROUPS)``: none)."""
    return next((i for i, group in enumerate(GROUPS) if under(name, group)), len(GROUPS))


def rank(df, metric: str):
    """``df`` by group (:data:`GROUPS`), most changed first by ``metric`` within each;
    rows where it is NaN (not compared, no relative change) last of their group."""
    sign = MOST_CHANGED_FIRST[metric]
    keys = {i: (group_of(name), math.inf if v != v else sign * v)
            for i, name, v in zip(df.index, df["name"], df[metric])}
    return df.loc[sorted(df.index, key=keys.__getitem__)]


def run(args) -> int:
    from ..history import History

    run_a, a, run_b, b = parse_targets(args.targets)
    with History(run_a) as ha:
        a = resolve_step(ha.store, a)
        names_a = {r.name for r in ha.store.records(a)}
        if run_b == run_a:
            b = resolve_step(ha.store, b)
            df, names_b = ha.diff(a, b, names=args.names), {r.name for r in ha.store.records(b)}
        else:
            with History(run_b) as hb:
                b = resolve_step(hb.store, b)
                df, names_b = ha.diff(a, b, names=args.names, other=hb), {r.name for r in hb.store.records(b)}
    if df.empty:
        raise KeyError(f"step {a} of {run_a} and step {b} of {run_b} have no tensor in common")
    if not (args.names or args.all):
        df = df[~df["integral"]]
    df = rank(df, args.sort)
    if args.top:
        df = df.head(args.top)
    records = df.to_dict("records")
    data = [{k: (None if v is None else list(v)) if k in ("shape", "shape_b") else v for k, v in row.items()}
            for row in records]
    # a tensor whose shape changed is not compared: its shape cell says from what to what
    rows = [[r["name"], shape_text(r["shape"]) + (f" -> {shape_text(r['shape_b'])}" if r["note"] else ""),
             *(r[m] for m in METRICS)] for r in records]
    # too narrow a terminal for every name apart: the metrics not ranked by give way first
    gives_way = tuple(m for m in ("frac_changed", "max_abs", "l2", "cosine", "rel_l2") if m != args.sort)
    emit(args, ["name", "shape", *METRICS], rows, data, left=("name",), gives_way=gives_way)
    if not args.json:
        say_what_one_step_alone_holds(names_a, names_b, a, b, args.names)
        if a == b and os.path.realpath(run_a) == os.path.realpath(run_b):
            print(f"(step {a} compared with itself: nothing changed)", file=sys.stderr)
    return 0


def say_what_one_step_alone_holds(names_a: set[str], names_b: set[str], a: int, b: int, patterns) -> None:
    """A line on stderr for the tensors that one step holds and the other not (a trajectory
    point keeps only the trajectory's): left out of the comparison, not unchanged."""
    from ..history import compared
    from ..items import selected_names

    chosen = None if patterns is None else selected_names(sorted(names_a | names_b), patterns)
    only = [(len([n for n in mine - theirs if compared(n, chosen)]), step)
            for mine, theirs, step in ((names_a, names_b, a), (names_b, names_a, b))]
    parts = [f"{counted(n, 'tensor')} only in step {step}" for n, step in only if n]
    if parts:
        print(f"({', '.join(parts)}: not compared)", file=sys.stderr)


def shape_text(shape) -> str:
    return "x".join(map(str, shape)) or "()"
