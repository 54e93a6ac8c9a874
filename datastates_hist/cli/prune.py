"""``datastates-hist prune RUN --keep-last N --keep-every K``: retention.

Deletes the committed steps no rule keeps (never the newest step, nor the newest
restore point: the run stays restorable): index rows first,
so readers stop seeing them at once, then their data. A step that a kept step
is a delta against stays (such steps are counted on a second line, and listed
as ``bases`` with ``--json``). Takes the run's writer lock: it refuses while a
training process writes the run (that process can call ``Checkpointer.prune``).
``--dry-run`` only reads the index (no lock; a read-only run too) and prints the
steps that would be deleted and the bytes that would be freed (per step with
``--json``).
"""

from __future__ import annotations

from ..retention import doomed, newest_restore_point, policies, protect_bases, step_bytes, unkept
from . import add_command, count
from ..index import open_existing
from .output import add_json_flag, counted, emit, plural, size


def add_parser(sub):
    cmd = add_command(sub, "prune", help="delete steps that no retention rule keeps")
    cmd.add_argument("run", help="the run directory")
    cmd.add_argument("--keep-last", type=count, metavar="N", help="keep the N newest steps")
    cmd.add_argument("--keep-every", type=count, metavar="K", help="keep every step divisible by K")
    cmd.add_argument("--dry-run", action="store_true",
                     help="only say what would be deleted and freed (reads the run, read-only ones too)")
    add_json_flag(cmd)
    return cmd


def run(args) -> int:
    if args.keep_last is None and args.keep_every is None:
        raise ValueError("say what to keep: --keep-last N and/or --keep-every K")
    rules = policies(args.keep_last, args.keep_every)
    index = open_existing(args.run)  # a clear error for a missing run, before anything is created
    if args.dry_run:
        try:
            committed = index.steps()
            freed, bases, restorable = _plan(args.run, index, committed, rules)
        finally:
            index.close()
        removed, kept = sorted(freed), sorted(set(committed) - set(freed))
    else:
        index.close()
        from ..checkpointer import Checkpointer

        with Checkpointer(args.run) as ckpt:
            freed, bases, restorable = _plan(args.run, ckpt.index, ckpt.steps(), rules)  # as of taking the lock
            removed = ckpt.prune(args.keep_last, args.keep_every)
            kept = ckpt.steps()
    nbytes = sum(freed.get(s, 0) for s in removed)
    if args.json:
        emit(args, [], [], {"removed": removed, "kept": kept, "bytes": nbytes, "dry_run": args.dry_run,
                            "freed": [{"step": s, "bytes": freed.get(s, 0)} for s in removed],
                            "bases": bases, "kept_restore_point": restorable})
        return 0
    verb, freeing = ("would delete", "would free") if args.dry_run else ("deleted", "freed")
    listed = f"; {freeing} {size(nbytes)} ({plural('step', len(removed))} {_spans(removed, kept)})" if removed else ""
    print(f"{verb} {counted(len(removed), 'step')}; {len(kept)} kept{listed}")
    if restorable is not None:
        print(f"step {restorable} kept: the newest restore point (no rule keeps it)")
    if bases:
        others = sorted(set(removed + kept) - set(bases))
        print(f"{len(bases)} kept only as delta bases of kept steps ({plural('step', len(bases))} "
              f"{_spans(bases, others)})")
    return 0


def _plan(run_dir: str, index, committed: list[int], rules) -> tuple[dict[int, int], list[int], int | None]:
    """``(freed, bases, restorable)``: step -> bytes for the ``committed`` steps to delete,
    the steps no rule keeps that stay as delta bases of kept steps, and the newest restore
    point where no rule keeps it (it stays), else None."""
    no_rule_keeps = unkept(index, committed, rules)
    victims = protect_bases(index, no_rule_keeps)
    newest = newest_restore_point(index)
    restorable = newest if newest in doomed(committed, rules) else None
    return step_bytes(run_dir, index, victims), sorted(set(no_rule_keeps) - set(victims)), restorable


def _spans(removed: list[int], kept: list[int]) -> str:
    """``removed`` as spans of three or more neighbouring committed steps and
    single steps: ``1..4, 6, 7``."""
    doomed_set, spans = set(removed), [[]]
    for step in sorted(removed + kept):
        if step in doomed_set:
            spans[-1].append(step)
        elif spans[-1]:
            spans.append([])
    shown = [f"{span[0]}..{span[-1]}" if len(span) > 2 else ", ".join(map(str, span)) for span in spans if span]
    return ", ".join(shown)
