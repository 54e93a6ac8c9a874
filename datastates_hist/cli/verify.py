"""``datastates-hist verify RUN [STEP ...]``: re-read every tensor and check its checksum.

A STEP is a committed step, ``latest``, or a negative number counting back from
the newest (-1 the newest); without one, every step is checked.

Exit 0 when every step checked is intact, 1 when anything is damaged (each
problem is printed with its step and tensor), 3 for a missing run or step,
4 when the index itself is damaged (then see ``datastates-hist repair``).
"""

from __future__ import annotations

import sys

from . import EXIT_FAILED, STEP_HELP, add_command, resolve_step, step_choice
from .output import add_json_flag, counted, emit, size


def add_parser(sub):
    cmd = add_command(sub, "verify", help="check every tensor of a run against its checksum")
    cmd.add_argument("run", help="the run directory")
    cmd.add_argument("steps", type=step_choice, nargs="*", metavar="STEP",
                     help=f"steps to check (default: every step); each {STEP_HELP}")
    add_json_flag(cmd)
    return cmd


def run(args) -> int:
    from ..store import Store
    from ..verify import verify_run

    store = Store(args.run)
    try:
        # a step named twice (3 and latest) is checked once
        steps = dict.fromkeys(resolve_step(store, s) for s in args.steps)
        rows = [store.row(s) for s in steps] if steps else store.index.step_rows()
    finally:
        store.close()
    checked = {"steps": set(), "tensors": 0, "bytes": 0}

    def count(step, tensor, nbytes):
        checked["steps"].add(step)
        checked["tensors"] += tensor is not None
        checked["bytes"] += nbytes

    with _progress_bar(sum(r.nbytes for r in rows), quiet=args.json) as advance:
        def progress(step, tensor, nbytes):
            count(step, tensor, nbytes)
            advance(nbytes, f"step {step}")

        problems = verify_run(args.run, [r.step for r in rows], progress)
    summary = {"run": args.run, "steps": len(checked["steps"]), "tensors": checked["tensors"],
               "bytes": checked["bytes"], "problems": [p.to_json() for p in problems]}
    if args.json:
        emit(args, [], [], summary)
    elif problems:
        emit(args, ["step", "tensor", "problem"],
             [[str(p.step), p.tensor or "(whole step)", p.message] for p in problems], None,
             left=("tensor", "problem"), wrap="problem", names="tensor")
        print(f"{len(problems)} problem(s) in {len({p.step for p in problems})} of "
              f"{counted(summary['steps'], 'step')} of {args.run}", file=sys.stderr)
    else:
        print(f"verified {counted(summary['steps'], 'step')}, {counted(summary['tensors'], 'tensor')}, "
              f"{size(summary['bytes'])} of {args.run}: every checksum matches")
    return EXIT_FAILED if problems else 0


class _progress_bar:
    """A rich progress bar on stderr, shown only in a terminal; yields ``advance(n, label)``."""

    def __init__(self, total: int, quiet: bool):
        self.total, self.quiet = total, quiet or not sys.stderr.isatty()

    def __enter__(self):
        if self.quiet:
            return lambda n, label: None
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                            TimeRemainingColumn(), console=Console(stderr=True), transient=True)
        self.bar.start()
        task = self.bar.add_task("verifying", total=self.total)
        return lambda n, label: self.bar.update(task, advance=n, description=label)

    def __exit__(self, *exc):
        if not self.quiet:
            self.bar.stop()
