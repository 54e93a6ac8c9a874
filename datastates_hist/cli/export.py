"""``datastates-hist export RUN STEP --to PATH``: one step's tensors as safetensors, a torch
file or a PyTorch DCP checkpoint.

By default the model's tensors, named as in ``model.state_dict()`` (so that
``model.load_state_dict`` takes them); ``--all`` exports every tensor under its
full stored name. ``FILE.safetensors`` is written with the safetensors library,
``FILE.pt`` or ``FILE.pth`` with ``torch.save``, a folder ``DIR.dcp`` (or any
PATH with ``--format dcp``) with ``torch.distributed.checkpoint.save`` in this
process alone, so that ``dcp.load(model.state_dict(), checkpoint_id=DIR)``
takes it. Tensor names are keys inside the checkpoint's metadata, never paths:
no name can write elsewhere. The checkpoint is written beside PATH and renamed
into place (a temporary left by an earlier export is removed first, a link
never followed). An existing PATH is replaced only with ``--force``, and a
folder only when it is a DCP checkpoint (``.metadata`` and ``*.distcp`` files,
nothing else): ``--force`` never deletes a folder of other files.

A trajectory point is exported as it reads, and stderr says where that differs
from a restore point: its tensors rounded to ``keep_bits`` (a lossy trajectory's:
named, with their bits and relative error bound as ``show`` gives them; a
safetensors file also records each in its metadata, ``keep_bits``: a JSON object
of tensor name -> mantissa bits kept), and the tensors a restore point holds that
it lacks (the optimizer's state, RNG, extras with ``--all``). A restore point's
export is exact and says nothing.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

from ..durable import remove_tree
from . import STEP_HELP, add_command, resolve_step, step_choice

FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".dcp": "dcp"}
SHOWN = 5  # tensors a note names; more are counted


def add_parser(sub):
    cmd = add_command(sub, "export", help="write one step's tensors to safetensors, a torch file or a DCP checkpoint")
    cmd.add_argument("run", help="the run directory")
    cmd.add_argument("step", type=step_choice, help=STEP_HELP)
    cmd.add_argument("--to", required=True, metavar="PATH",
                     help="FILE.safetensors, FILE.pt / FILE.pth for torch.save, or a folder DIR.dcp for PyTorch DCP")
    cmd.add_argument("--format", choices=sorted(set(FORMATS.values())),
                     help="the format to write (default: from PATH's suffix)")
    cmd.add_argument("--all", action="store_true", help="every tensor (optimizer, RNG, extras), by full name")
    cmd.add_argument("--force", action="store_true", help="replace PATH if it exists")
    return cmd


def check_target(path: str, force: bool, kind: str | None = None, run: str | None = None) -> str:
    """The format to write ``path`` in (``kind``, else from its suffix); a clear error
    before any step is read. ``path`` never lies inside ``run``: an export must not
    replace a file of the history it reads."""
    from ..importing.reading import is_inside

    suffix = os.path.splitext(os.path.normpath(path))[1].lower()
    if kind is None and suffix not in FORMATS:
        raise ValueError(f"cannot write {path}: export writes {', '.join(FORMATS)} files "
                         "(or say which with --format)")
    kind = kind or FORMATS[suffix]
    if run is not None and os.path.isdir(run) and is_inside(run, path):
        raise ValueError(f"cannot write {path}: it is inside the run {run}; export to a path outside it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {path}: there is no folder {folder}")
    if os.path.lexists(path):
        if not force:
            raise ValueError(f"{path} exists: use --force to replace it")
        if kind == "dcp" and not is_dcp_output(path):
            raise ValueError(f"cannot replace {path}: it is not a DCP checkpoint (a folder of .metadata and "
                             "*.distcp files only), and --force replaces nothing else with one")
        if kind != "dcp" and os.path.isdir(path) and not os.path.islink(path):
            raise ValueError(f"cannot replace {path}: it is a folder, and --force replaces only a file with a file")
    return kind


def is_dcp_output(path: str, partial: bool = False) -> bool:
    """Whether ``path`` is a folder of DCP's files only (``.metadata`` and ``*.distcp``,
    plain files): one export may replace; ``partial``: one left by an interrupted
    export (``.metadata`` perhaps missing, or still ``.metadata.tmp``)."""
    from ..importing.dcp_folders import DCP_DATA_SUFFIX, DCP_METADATA, DCP_METADATA_TMP

    if os.path.islink(path) or not os.path.isdir(path):
        return False
    entries = os.listdir(path)
    allowed = {DCP_METADATA, DCP_METADATA_TMP} if partial else {DCP_METADATA}
    return (partial or DCP_METADATA in entries) and all(
        (name in allowed or name.endswith(DCP_DATA_SUFFIX))
        and os.path.isfile(os.path.join(path, name)) and not os.path.islink(os.path.join(path, name))
        for name in entries)


def remove_stale_temporary(tmp: str, kind: str) -> None:
    """Remove what an interrupted export left at ``tmp``: a file, a link (itself, never
    what it points at), or a partial DCP folder; refuse to remove any other folder."""
    if not os.path.lexists(tmp):
        return
    if os.path.isdir(tmp) and not os.path.islink(tmp) and not (kind == "dcp" and is_dcp_output(tmp, partial=True)):
        raise ValueError(f"cannot write beside {tmp}: a folder is there that no export left; move it away")
    remove_tree(tmp)


def run(args) -> int:
    from ..history import History
    from ..items import MODEL_PREFIX, short_name

    target = os.path.normpath(args.to)  # one name for the checks, the temporary and the rename
    kind = check_target(target, args.force, args.format, args.run)
    with History(args.run) as h:
        step = resolve_step(h.store, args.step)
        data = h.step_data(step)
        names = list(data.records)  # of the step as opened: retention may demote it meanwhile
        if not args.all:
            names = [n for n in names if n.startswith(MODEL_PREFIX)]
            if not names:
                raise KeyError(f"step {step} of {args.run} holds no model tensors (try --all)")
        if kind == "safetensors":  # before any tensor is read or anything written
            check_safetensors_dtypes({(n if args.all else short_name(n)): data.records[n].dtype for n in names})
        tensors = {(n if args.all else short_name(n)): data.read(n).contiguous() for n in names}
        rounded = {(n if args.all else short_name(n)): data.records[n] for n in names
                   if data.records[n].rounded_bits is not None}  # as read: what was written
        notes = export_notes(h, step, data, names, rounded, args.all)
    tmp, aside = target + ".partial", None
    remove_stale_temporary(tmp, kind)
    if kind == "dcp":
        remove_stale_temporary(target + ".replaced", kind)  # what an export interrupted in its rename left
    try:
        if kind == "dcp":
            write_dcp(tensors, tmp, target)
        elif kind == "safetensors":
            from safetensors.torch import save_file

            metadata = {"run": os.path.abspath(args.run), "step": str(step)}
            if rounded:
                metadata["keep_bits"] = json.dumps({name: rec.keep_bits for name, rec in rounded.items()})
            save_file(tensors, tmp, metadata=metadata)
            os.chmod(tmp, 0o666 & ~current_umask())  # safetensors makes it private (0600); an export is shared
        else:
            import torch

            with open(tmp, "wb") as f:  # through a Python file: its OSError says why a write failed
                torch.save(tensors, f)
        if kind == "dcp" and os.path.lexists(target):  # a DCP checkpoint (check_target)
            aside = target + ".replaced"  # a folder cannot be renamed over: moved aside until the new one is in
            os.rename(target, aside)
        os.replace(tmp, target)
    except BaseException as exc:
        if aside is not None and not os.path.lexists(target) and os.path.lexists(aside):
            os.rename(aside, target)  # the old checkpoint back where it was
        remove_tree(tmp)  # a half-written temporary
        if isinstance(exc, (OSError, RuntimeError)) or type(exc).__name__ == "SafetensorError":
            raise OSError(f"cannot write {target}: {write_failure(exc)}") from exc
        raise
    if aside is not None:
        remove_tree(aside)
    print(f"wrote {len(tensors)} tensors of step {step} to {target}")
    for note in notes:
        print(f"datastates-hist: {note}", file=sys.stderr)
    return 0


def check_safetensors_dtypes(dtypes: dict[str, str]) -> None:
    """Refuse tensors (export name -> stored dtype name) of a dtype the installed safetensors
    cannot write and read back, complex128 for one: its own error is a bare KeyError of the dtype."""
    from safetensors import torch as st

    from ..dtypes import torch_dtype

    # its own tables, since versions differ in the dtypes they hold: those it writes (_SIZE) and reads back (_TYPES)
    sizes, types = getattr(st, "_SIZE", None), getattr(st, "_TYPES", None)
    if not isinstance(sizes, dict) or not isinstance(types, dict):
        return  # tables of another shape: left to save_file
    held = set(sizes) & set(types.values())
    bad = {name: dtype for name, dtype in dtypes.items() if torch_dtype(dtype) not in held}
    if len(bad) == 1:
        (name, dtype), = bad.items()
        raise ValueError(f"safetensors cannot store tensor {name!r} of dtype {dtype}; export it --to a .pt file "
                         "or a DCP folder (.dcp)")
    if bad:
        kinds = " or ".join(sorted(set(bad.values())))
        raise ValueError(f"safetensors cannot store {len(bad)} tensors of dtype {kinds}: {listed(list(bad))}; "
                         "export them --to a .pt file or a DCP folder (.dcp)")


def export_notes(h, step: int, data, names: list[str], rounded: dict, every: bool) -> list[str]:
    """What stderr says of an export of ``step`` (open as ``data``) that is not what a
    restore point gives: its ``rounded`` tensors (export name -> record), and the
    tensors of the nearest restore point in the export's scope (the model's, or
    ``every`` tensor) that a trajectory point lacks. [] for a restore point."""
    from ..items import MODEL_PREFIX
    from .show import rounding_note

    notes = []
    trajectory = data.row.tier == "trajectory"
    if rounded:
        where = f"step {step} of {h.path} is a trajectory point: " if trajectory else ""
        notes.append(f"{where}{len(rounded)} of the {len(names)} tensors written are {rounding_note(rounded.values())}"
                     f", not exact: {listed(list(rounded))}")
    if trajectory:
        points = h.restore_points
        near = min(points, key=lambda p: (abs(p - step), p), default=None)
        held = h.names(near) if near is not None else h.names()
        lacking = [n for n in held if n not in data.records and (every or n.startswith(MODEL_PREFIX))]
        if lacking:
            groups = Counter(n.split("/", 1)[0] + "/*" if "/" in n else n for n in lacking)
            what = ", ".join(f"{group}: {count}" for group, count in sorted(groups.items()))
            than = f"restore point {near} (the nearest)" if near is not None else "other steps"
            notes.append(f"step {step} of {h.path} is a trajectory point, which keeps only the trajectory's tensors: "
                         f"it lacks {len(lacking)} tensor(s) that {than} holds ({what}), and so does the export")
    return notes


def listed(names: list[str]) -> str:
    """The first :data:`SHOWN` of ``names``, and how many more."""
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def current_umask() -> int:
    mask = os.umask(0)  # the only way to read it; set back at once (the command runs one thread)
    os.umask(mask)
    return mask


def write_failure(exc: BaseException) -> str:
    """Why a write failed, in a few words: the system's reason where there is one
    (torch and safetensors wrap it in text of their own)."""
    from ..importing.reading import first_line

    seen = exc
    while seen is not None:  # torch's error names none: the OSError it met is its context
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        seen = seen.__cause__ or seen.__context__
    return first_line(exc)


def write_dcp(tensors: dict, tmp: str, path: str) -> None:
    """``tensors`` as a DCP checkpoint folder at ``tmp`` (renamed to ``path`` by the
    caller), written in this process alone."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ..importing.dcp_folders import checkpoint_failure

    try:
        with warnings.catch_warnings():  # DCP warns that it runs without a process group: so it should
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
    except CheckpointException as exc:  # a BaseException: each rank's failure inside
        raise OSError(write_failure(checkpoint_failure(exc))) from None  # the caller names the path
