"""``datastates-hist import RUN SOURCE...``: a history built from existing checkpoints.

Each SOURCE (a ``torch.save`` file, Lightning's ``.ckpt`` among them, a
safetensors file, a transformers ``checkpoint-N`` or ``save_pretrained``
folder, a PyTorch DCP folder) becomes one step, numbered from its name (the
first run of ASCII digits in it, or the one group of ``--step-from REGEX``), in
step order; a source with optimizer state (or a Trainer's RNG states) becomes
a restore point, the others trajectory points, which keep every tensor of the
source but this process's RNG state. No source can run code (torch files are
read with ``weights_only=True``). RUN is created if missing, and removed again
if no step could be imported into it; a RUN that has steps takes only steps
after its newest. A step's line is printed once it is committed. A missing
SOURCE exits 3. See :mod:`datastates_hist.importing`.
"""

from __future__ import annotations

import sys

from ..retention import CODECS
from . import EXIT_MISSING, add_command
from .output import size


def add_parser(sub):
    cmd = add_command(sub, "import", help="build a history from torch.save, safetensors, transformers or DCP "
                                        "checkpoints")
    cmd.add_argument("run", help="the run directory (created if missing)")
    cmd.add_argument("sources", nargs="+", metavar="SOURCE",
                     help="a .pt/.pth/.bin/.ckpt or .safetensors file, a transformers checkpoint folder, a DCP folder")
    cmd.add_argument("--step-from", metavar="REGEX",
                     help=r"the step in each source's name: a regular expression with one group, e.g. 'step_(\d+)' "
                          "(default: the first run of ASCII digits in the name)")
    cmd.add_argument("--backend", choices=("adios2", "hdf5"),
                     help="the backend to write the steps with (default: the run's, adios2 for a new run)")
    cmd.add_argument("--codec", choices=CODECS, default="delta", help="how tensors are stored (default delta)")
    cmd.add_argument("--optimizer-type", metavar="CLASS", default=None,
                     help="the optimizer's class name to record (AdamW, ...): a state dict does not say it")
    return cmd


def run(args) -> int:
    from ..importing import DEFAULT_OPTIMIZER_TYPE, import_sources
    from ..importing.sources import find_sources

    try:
        sources = find_sources(args.sources, args.step_from)  # every source checked before the run is opened
    except FileNotFoundError as exc:  # a missing source: exit 3, as a missing run or step
        print(f"datastates-hist: {exc}", file=sys.stderr)
        return EXIT_MISSING

    def report(step) -> None:  # once the step is committed
        kind = "restore point" if step.restore_point else "trajectory point"
        print(f"step {step.source.step}: {step.source.path} ({step.source.kind}), {step.tensors} model tensors, "
              f"{size(step.nbytes)}, {kind}", flush=True)

    imported = import_sources(args.run, sources, backend=args.backend, codec=args.codec,
                              optimizer_type=args.optimizer_type or DEFAULT_OPTIMIZER_TYPE, on_step=report)
    restore = sum(s.restore_point for s in imported)
    print(f"imported {_count(len(imported), 'step')} into {args.run}: {_count(restore, 'restore point')}, "
          f"{_count(len(imported) - restore, 'trajectory point')}")
    return 0


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")
