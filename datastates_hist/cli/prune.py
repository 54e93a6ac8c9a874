"""``datastates-hist prune RUN --keep-last N --keep-every K``: retention.

Deletes the committed steps no rule keeps (never the newest): index rows first,
so readers stop seeing them at once, then their data. Takes the run's writer
lock: it refuses while a training process writes the run (that process can
call ``Checkpointer.prune``). ``--dry-run`` only reads the index (no lock; a
read-only run too) and prints the steps and bytes that would be deleted.
"""

from __future__ import annotations

from ..retention import doomed, policies
from ..store import Store
from .output import add_json_flag, emit, size


def add_parser(sub):
    cmd = sub.add_parser("prune", help="delete steps that no retention rule keeps")
    cmd.add_argument("run", help="the run directory")
    cmd.add_argument("--keep-last", type=int, metavar="N", help="keep the N newest steps")
    cmd.add_argument("--keep-every", type=int, metavar="K", help="keep every step divisible by K")
    cmd.add_argument("--dry-run", action="store_true",
                     help="only say what would be deleted (reads the run, read-only ones too)")
    add_json_flag(cmd)
    return cmd


def run(args) -> int:
    rules = policies(args.keep_last, args.keep_every)
    store = Store(args.run)  # a clear error for a missing run, before anything is created
    try:
        sizes = {r.step: r.nbytes for r in store.index.step_rows()}
    finally:
        store.close()
    if args.dry_run:
        removed = doomed(list(sizes), rules)
        kept = sorted(set(sizes) - set(removed))
    else:
        from ..checkpointer import Checkpointer

        with Checkpointer(args.run) as ckpt:
            sizes = {r.step: r.nbytes for r in ckpt.index.step_rows()}  # as of taking the lock
            removed = ckpt.prune(args.keep_last, args.keep_every)
            kept = ckpt.steps()
    nbytes = sum(sizes.get(s, 0) for s in removed)
    data = {"removed": removed, "kept": kept, "bytes": nbytes, "dry_run": args.dry_run}
    if args.json:
        emit(args, [], [], data)
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    listed = f" ({size(nbytes)}: steps {', '.join(map(str, removed))})" if removed else ""
    print(f"{verb} {len(removed)} steps; {len(kept)} kept{listed}")
    return 0
