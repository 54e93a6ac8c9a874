"""``datastates-hist export RUN STEP --to FILE``: one step's tensors as safetensors or a torch file.

By default the model's tensors, named as in ``model.state_dict()`` (so that
``model.load_state_dict`` takes them); ``--all`` exports every tensor under its
full stored name. ``.safetensors`` files are written with the safetensors
library; any other suffix is a ``torch.save`` state dict.
"""

from __future__ import annotations

import os

from ..history import History
from ..items import MODEL_PREFIX, short_name
from . import step_number


def add_parser(sub):
    cmd = sub.add_parser("export", help="write one step's tensors to safetensors or a torch file")
    cmd.add_argument("run", help="the run directory")
    cmd.add_argument("step", type=step_number, help="a committed step")
    cmd.add_argument("--to", required=True, metavar="FILE", help="FILE.safetensors, or FILE.pt for torch.save")
    cmd.add_argument("--all", action="store_true", help="every tensor (optimizer, RNG, extras), by full name")
    return cmd


def run(args) -> int:
    folder = os.path.dirname(os.path.abspath(args.to))
    if not os.path.isdir(folder):  # found before reading the step
        raise FileNotFoundError(f"cannot write {args.to}: there is no folder {folder}")
    with History(args.run) as h:
        names = h.names(args.step)
        if not args.all:
            names = [n for n in names if n.startswith(MODEL_PREFIX)]
            if not names:
                raise KeyError(f"step {args.step} of {args.run} holds no model tensors (try --all)")
        data = h.step_data(args.step)
        tensors = {(n if args.all else short_name(n)): data.read(n).contiguous() for n in names}
    tmp = args.to + ".partial"
    if args.to.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(tensors, tmp, metadata={"run": os.path.abspath(args.run), "step": str(args.step)})
    else:
        import torch

        torch.save(tensors, tmp)
    os.replace(tmp, args.to)
    print(f"wrote {len(tensors)} tensors of step {args.step} to {args.to}")
    return 0
