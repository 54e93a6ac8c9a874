"""``datastates-hist repair RUN``: rebuild a damaged or lost index from the step data.

The new index is built aside and renamed into place, so a repair killed
part-way leaves the run as it was (or, killed between the last renames,
without an index until the next repair); a damaged old index is moved aside
(``index.sqlite.damaged-<time>``), never deleted, and a healthy one rebuilt with
``--force`` is kept as ``index.sqlite.previous`` (one file, replaced by the next
such repair); steps whose data is damaged are moved to ``RUN/damaged/``. To try
such a unit again, move it back into ``RUN/steps/`` and run repair again.
Refuses while a writer holds the run. Exit 0 when the index is healthy or was
rebuilt from every step unit, 1 when some unit could not be committed.
"""

from __future__ import annotations

import os

from . import EXIT_FAILED, add_command
from .output import add_json_flag, emit


def add_parser(sub):
    cmd = add_command(sub, "repair", help="rebuild a damaged index from the step data")
    cmd.add_argument("run", help="the run directory")
    cmd.add_argument("--force", action="store_true", help="rebuild even when the index looks healthy")
    cmd.add_argument("--no-verify", dest="verify", action="store_false",
                     help="commit steps whose manifest parses without reading every tensor")
    add_json_flag(cmd)
    return cmd


def run(args) -> int:
    from ..repair import PREVIOUS_INDEX_SUFFIX, repair_run

    report = repair_run(args.run, force=args.force, verify=args.verify)
    if args.json:
        emit(args, [], [], report.to_json())
        return EXIT_FAILED if report.set_aside else 0
    print(f"{args.run}: {report.diagnosis}")
    if report.leftover_removed:
        print("  removed the half-built index of an earlier repair that did not finish")
    if report.rebuilt:
        if report.moved_index and report.moved_index.endswith(PREVIOUS_INDEX_SUFFIX):
            print(f"  the old index was kept as {report.moved_index} (the next repair --force replaces it)")
        elif report.moved_index:
            print(f"  the old index was moved to {report.moved_index}")
        steps = report.steps
        span = f" ({steps[0]}..{steps[-1]})" if steps else ""
        print(f"  rebuilt the index with {len(steps)} steps{span}")
        for unit, why in report.set_aside.items():
            print(f"  not committed, moved to damaged/{unit}: {why}")
        if report.lost:
            print(f"  steps the old index named whose data is gone: {', '.join(map(str, report.lost))}")
    if report.in_damaged:
        print(f"  {os.path.join(args.run, 'damaged')} holds {len(report.in_damaged)} unit(s) set aside by "
              "repair; to try one again, move it back into steps/ and run repair again")
    return EXIT_FAILED if report.set_aside else 0
