"""``datastates-hist prune RUN --keep-last N --keep-every K``: retention.

Deletes the committed steps no rule keeps (never the newest): index rows first,
so readers stop seeing them at once, then their data. Takes the run's writer
lock: it refuses while a training process writes the run (that process can
call ``Checkpointer.prune``).
"""

from __future__ import annotations

from ..store import Store
from .output import add_json_flag, emit


def add_parser(sub):
    cmd = sub.add_parser("prune", help="delete steps that no retention rule keeps")
    cmd.add_argument("run", help="the run directory")
    cmd.add_argument("--keep-last", type=int, metavar="N", help="keep the N newest steps")
    cmd.add_argument("--keep-every", type=int, metavar="K", help="keep every step divisible by K")
    cmd.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    add_json_flag(cmd)
    return cmd


def run(args) -> int:
    from ..checkpointer import Checkpointer

    Store(args.run).close()  # a clear error for a missing run, before anything is created
    with Checkpointer(args.run) as ckpt:
        removed = ckpt.prune(args.keep_last, args.keep_every, dry_run=args.dry_run)
        kept = ckpt.steps()
    verb = "would delete" if args.dry_run else "deleted"
    data = {"removed": removed, "kept": kept, "dry_run": args.dry_run}
    if args.json:
        emit(args, [], [], data)
    else:
        print(f"{verb} {len(removed)} steps; {len(kept) if not args.dry_run else len(kept) - len(removed)} kept")
    return 0
