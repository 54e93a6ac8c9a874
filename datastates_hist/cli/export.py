"""``datastates-hist export RUN STEP --to FILE``: one step's tensors as safetensors or a torch file.

By default the model's tensors, named as in ``model.state_dict()`` (so that
``model.load_state_dict`` takes them); ``--all`` exports every tensor under its
full stored name. ``FILE.safetensors`` is written with the safetensors library,
``FILE.pt`` or ``FILE.pth`` with ``torch.save``. Tensor names are keys inside
that one file, never paths: no name can write elsewhere. An existing FILE is
replaced only with ``--force``.
"""

from __future__ import annotations

import os

from . import STEP_HELP, resolve_step, step_choice

FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch"}


def add_parser(sub):
    cmd = sub.add_parser("export", help="write one step's tensors to safetensors or a torch file")
    cmd.add_argument("run", help="the run directory")
    cmd.add_argument("step", type=step_choice, help=STEP_HELP)
    cmd.add_argument("--to", required=True, metavar="FILE",
                     help="FILE.safetensors, or FILE.pt / FILE.pth for torch.save")
    cmd.add_argument("--all", action="store_true", help="every tensor (optimizer, RNG, extras), by full name")
    cmd.add_argument("--force", action="store_true", help="replace FILE if it exists")
    return cmd


def check_target(path: str, force: bool) -> str:
    """The format to write ``path`` in; a clear error before any step is read."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FORMATS:
        raise ValueError(f"cannot write {path}: export writes {', '.join(FORMATS)} files")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {path}: there is no folder {folder}")
    if os.path.lexists(path) and not force:
        raise ValueError(f"{path} exists: use --force to replace it")
    return FORMATS[suffix]


def run(args) -> int:
    from ..history import History
    from ..items import MODEL_PREFIX, short_name

    kind = check_target(args.to, args.force)
    with History(args.run) as h:
        step = resolve_step(h.store, args.step)
        names = h.names(step)
        if not args.all:
            names = [n for n in names if n.startswith(MODEL_PREFIX)]
            if not names:
                raise KeyError(f"step {step} of {args.run} holds no model tensors (try --all)")
        data = h.step_data(step)
        tensors = {(n if args.all else short_name(n)): data.read(n).contiguous() for n in names}
    tmp = args.to + ".partial"
    if kind == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, tmp, metadata={"run": os.path.abspath(args.run), "step": str(step)})
    else:
        import torch

        torch.save(tensors, tmp)
    os.replace(tmp, args.to)
    print(f"wrote {len(tensors)} tensors of step {step} to {args.to}")
    return 0
