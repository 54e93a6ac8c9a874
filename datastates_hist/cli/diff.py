"""``datastates-hist diff``: how tensors changed between two steps, of one run or two runs.

    datastates-hist diff RUN A B [--names GLOB] [--top N] [--sort METRIC]
    datastates-hist diff RUN_A:STEP RUN_B:STEP
"""

from __future__ import annotations

import math
from argparse import ArgumentTypeError

from ..history import History
from . import step_number
from .output import add_json_flag, emit, num

METRICS = ("l2", "rel_l2", "max_abs", "cosine", "frac_changed")


def add_parser(sub):
    cmd = sub.add_parser("diff", help="compare the tensors of two steps",
                         description="Compare RUN at steps A and B, or RUN_A:STEP with RUN_B:STEP.")
    cmd.add_argument("targets", nargs="+", metavar="RUN A B | RUN_A:STEP RUN_B:STEP")
    cmd.add_argument("--names", action="append", metavar="GLOB",
                     help="only tensors matching GLOB ('model/' may be left out); repeatable")
    cmd.add_argument("--top", type=int, metavar="N", help="only the N tensors first in the sort")
    cmd.add_argument("--sort", choices=METRICS, default="rel_l2",
                     help="sort by this metric, largest first (default rel_l2)")
    add_json_flag(cmd)
    return cmd


def parse_targets(targets: list[str]) -> tuple[str, int, str, int]:
    """``RUN A B`` or ``RUN_A:STEP RUN_B:STEP`` -> (run_a, step_a, run_b, step_b)."""
    try:
        if len(targets) == 3:
            return targets[0], step_number(targets[1]), targets[0], step_number(targets[2])
        if len(targets) == 2 and all(":" in t for t in targets):
            (ra, sa), (rb, sb) = (t.rsplit(":", 1) for t in targets)
            return ra, step_number(sa), rb, step_number(sb)
    except ArgumentTypeError:
        pass
    raise ValueError(f"diff takes RUN A B or RUN_A:STEP RUN_B:STEP, got {' '.join(targets)}")


def run(args) -> int:
    run_a, a, run_b, b = parse_targets(args.targets)
    with History(run_a) as ha:
        if run_b == run_a:
            df = ha.diff(a, b, names=args.names)
        else:
            with History(run_b) as hb:
                df = ha.diff(a, b, names=args.names, other=hb)
    key = df[args.sort].map(lambda v: -math.inf if v != v else v)  # NaN last
    df = df.loc[key.sort_values(ascending=False).index]
    if args.top:
        df = df.head(args.top)
    data = [{k: (list(v) if k == "shape" else v) for k, v in row.items()} for row in df.to_dict("records")]
    rows = [[r["name"], "x".join(map(str, r["shape"])) or "()", *(num(r[m]) for m in METRICS), r["note"]]
            for r in df.to_dict("records")]
    emit(args, ["name", "shape", *METRICS, "note"], rows, data, left=("name", "note"))
    return 0
