"""Finding the checkpoints to import, the step each becomes, and what each holds:
``torch.save`` files, safetensors files, transformers folders (a Trainer's
``checkpoint-N``, ``save_pretrained``) and DCP folders."""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..collect import step_number
from ..values import MAX_DEPTH
from .dcp_folders import DCP_METADATA, read_dcp
from .reading import check_regular, first_line, load_safetensors, load_torch, read_json

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")  # .ckpt: Lightning's torch.save files
SAFETENSORS_SUFFIX = ".safetensors"
# the files of a transformers checkpoint folder
HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
HF_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
HF_OPTIMIZER, HF_SCHEDULER, HF_SCALER, HF_RNG = "optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth"
HF_JSON_EXTRAS = {"trainer_state.json": "trainer_state", "config.json": "config"}
# keys of a torch.save dict that hold the model's or the optimizer's state dict
MODEL_KEYS = ("model", "model_state_dict", "state_dict", "module")
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim")

SOURCE_HELP = ("a .pt/.pth/.bin/.ckpt torch.save file, a .safetensors file, a transformers checkpoint folder "
               "(checkpoint-N, save_pretrained) or a PyTorch DCP folder")


@dataclass(frozen=True)
class Source:
    """One checkpoint to import: its path, the step it becomes, and its kind
    (``torch``, ``safetensors``, ``transformers`` or ``dcp``)."""

    path: str
    step: int
    kind: str


@dataclass
class Contents:
    """What a source holds, as the objects one ``Checkpointer.write`` takes."""

    model: dict[str, torch.Tensor]
    optimizer: dict | None = None  # a torch optimizer state dict
    extra: dict[str, Any] = field(default_factory=dict)
    rng: dict | None = None  # the states of transformers' rng_state.pth

    @property
    def restore_point(self) -> bool:
        """Whether the source holds training state beyond its model and extras (an
        optimizer's, a Trainer's RNG states): its step stays a restore point."""
        return self.optimizer is not None or self.rng is not None


# --- finding sources ---------------------------------------------------------------------

def source_kind(path: str) -> str:
    """The kind of the checkpoint at ``path``; a clear error for anything else."""
    if not os.path.lexists(path):
        raise FileNotFoundError(f"cannot import {path}: there is no such file or folder")
    if os.path.isdir(path):
        entries = set(os.listdir(path))
        if DCP_METADATA in entries:
            return "dcp"
        if entries & set(HF_WEIGHTS + HF_INDEXES):
            return "transformers"
        raise ValueError(f"cannot import {path}: a folder holding neither {DCP_METADATA} (DCP) nor "
                         f"{' / '.join(HF_WEIGHTS)} (transformers); a source is {SOURCE_HELP}")
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in TORCH_SUFFIXES + (SAFETENSORS_SUFFIX,):
        raise ValueError(f"cannot import {path}: unknown kind of file (a source is {SOURCE_HELP})")
    check_regular(path)
    return "safetensors" if suffix == SAFETENSORS_SUFFIX else "torch"


def step_pattern(regex: str | None) -> re.Pattern:
    """The pattern that finds a step in a source's name: the first run of ASCII digits
    by default, else ``regex`` (one group, matching a whole number)."""
    if regex is None:
        return DEFAULT_STEP_PATTERN
    try:
        pattern = re.compile(regex)
    except re.error as exc:
        raise ValueError(f"--step-from '{regex}' is not a regular expression: {exc}") from None
    if pattern.groups != 1:
        raise ValueError(f"--step-from '{regex}' needs exactly one group, the step's digits, "
                         r"such as 'step_(\d+)'")
    return pattern


DEFAULT_STEP_PATTERN = re.compile(r"([0-9]+)")


def step_of(path: str, pattern: re.Pattern) -> int:
    """The step that ``pattern`` finds in the name of ``path`` (a file's without its suffix)."""
    name = os.path.basename(os.path.normpath(path))
    if not os.path.isdir(path):
        name = os.path.splitext(name)[0]
    found = pattern.search(name)
    if pattern is DEFAULT_STEP_PATTERN and found is None:
        raise ValueError(f"cannot tell the step of {path}: no step number in its name {name!r} "
                         r"(give one with --step-from REGEX, e.g. 'step_(\d+)')")
    if found is None or found.group(1) is None:
        raise ValueError(f"cannot tell the step of {path}: --step-from '{pattern.pattern}' finds no step "
                         f"in its name {name!r}")
    digits = found.group(1)
    if not (digits.isascii() and digits.isdigit()):
        raise ValueError(f"cannot tell the step of {path}: --step-from found {digits!r} in its name, "
                         "not a whole number")
    return step_number(int(digits))


def find_sources(paths: list[str], step_from: str | None = None) -> list[Source]:
    """The sources at ``paths``, each with its kind and step, in step order.

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: a path is no checkpoint this module reads, its name holds no
            step, or two sources map to the same step.
    """
    pattern = step_pattern(step_from)
    by_step: dict[int, Source] = {}
    for path in paths:
        kind = source_kind(path)  # first: a missing path is named as missing, not as stepless
        source = Source(path, step_of(path, pattern), kind)
        twin = by_step.get(source.step)
        if twin is not None:
            raise ValueError(f"{twin.path} and {path} are both step {source.step}: leave one out, or tell "
                             "their steps apart with --step-from REGEX")
        by_step[source.step] = source
    return [by_step[s] for s in sorted(by_step)]


# --- reading sources ---------------------------------------------------------------------

def load_weights(path: str) -> dict[str, torch.Tensor]:
    """A file of model weights (safetensors or torch)."""
    if path.endswith(SAFETENSORS_SUFFIX):
        return load_safetensors(path)
    return _state_dict(load_torch(path), path)


def _state_dict(obj: Any, path: str) -> dict[str, torch.Tensor]:
    if not (isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values())):
        raise ValueError(f"cannot import {path}: expected a state dict (names -> tensors), found "
                         f"{_describe(obj)}")
    return dict(obj)


def _describe(obj: Any) -> str:
    if isinstance(obj, dict):
        keys = list(obj)[:4]
        return f"a dict with keys {', '.join(map(repr, keys))}{', ...' if len(obj) > 4 else ''}"
    return f"a {type(obj).__name__}"


def read_source(source: Source) -> Contents:
    """The model, optimizer state and extras of ``source``."""
    if source.kind == "safetensors":
        return Contents(load_safetensors(source.path))
    if source.kind == "transformers":
        return read_transformers(source.path)
    obj = load_torch(source.path) if source.kind == "torch" else read_dcp(source.path)
    return split_checkpoint(obj, source.path)


def split_checkpoint(obj: Any, path: str) -> Contents:
    """A ``torch.save``-style object as contents: a state dict (the model's), or a dict
    holding the model's state dict (``model``, ``state_dict``, ...), perhaps an
    optimizer's (``optimizer``, ...) and other entries (extras)."""
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return Contents(dict(obj))
    if isinstance(obj, dict):
        model_key = next((k for k in MODEL_KEYS if isinstance(obj.get(k), dict)), None)
        if model_key is not None:
            optim_key = next((k for k in OPTIMIZER_KEYS if k in obj), None)
            optimizer = None if optim_key is None else _optimizer_state(obj[optim_key], f"{path} [{optim_key!r}]")
            extra = _string_keys({k: v for k, v in obj.items() if k not in (model_key, optim_key)}, path)
            where = f"{path} [{model_key!r}]"
            return Contents(_state_dict(_flat(obj[model_key], where), where), optimizer, extra)
    raise ValueError(f"cannot import {path}: expected a state dict (names -> tensors) or a dict with one "
                     f"under {' / '.join(map(repr, MODEL_KEYS))}, found {_describe(obj)}")


def _string_keys(entries: dict, path: str) -> dict[str, Any]:
    """A checkpoint's entries by their keys as strings (the names of extras); two keys
    with one string (``1`` and ``"1"``) refused."""
    out: dict[str, Any] = {}
    for key, value in entries.items():
        name = str(key)
        if name in out:
            twin = next(k for k in entries if str(k) == name)
            raise ValueError(f"cannot import {path}: its keys {twin!r} and {key!r} would both be named {name!r}")
        out[name] = value
    return out


def _flat(tree: dict, where: str) -> dict:
    """A nested dict of tensors as one state dict with ``.``-joined names (a model's
    state dict as DCP and some trainers nest it); two entries of one name refused.
    Iterative (the dicts of a file can nest deeper than Python recurses), in order."""
    out: dict = {}
    open_dicts = [("", iter(tree.items()))]  # the dicts being walked, innermost last, each with its prefix
    while open_dicts:
        prefix, entries = open_dicts[-1]
        for key, value in entries:
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                if len(open_dicts) >= MAX_DEPTH:
                    raise ValueError(f"cannot import {where}: its dicts are nested more than {MAX_DEPTH} levels deep")
                open_dicts.append((f"{name}.", iter(value.items())))
                break
            if name in out:
                raise ValueError(f"cannot import {where}: two of its tensors are named {name!r} (one nested)")
            out[name] = value
        else:
            open_dicts.pop()
    return out


def _optimizer_state(obj: Any, where: str) -> dict:
    """An optimizer's state dict: ``param_groups`` dicts each with a ``params`` list
    of parameter keys (ints, or names), and ``state`` a dict of one per parameter."""
    if not (isinstance(obj, dict) and isinstance(obj.get("state"), dict)
            and isinstance(obj.get("param_groups"), list)):
        raise ValueError(f"cannot import {where}: expected an optimizer state dict (state, param_groups), "
                         f"found {_describe(obj)}")
    wrong = f"cannot import {where}: expected an optimizer state dict, but"
    seen: set = set()
    for n, group in enumerate(obj["param_groups"]):
        if not (isinstance(group, dict) and isinstance(group.get("params"), list)):
            raise ValueError(f"{wrong} its param_groups[{n}] is {_describe(group)}, not a dict with a 'params' list")
        for p in group["params"]:
            if not (isinstance(p, (int, str)) and not isinstance(p, bool)):
                raise ValueError(f"{wrong} its param_groups[{n}]['params'] holds {p!r}, not a parameter's index "
                                 "or name")
            if p in seen:  # as torch's optimizers refuse a parameter in two places
                raise ValueError(f"{wrong} its param_groups list the parameter {p!r} twice")
            seen.add(p)
    for key, entry in obj["state"].items():
        if not isinstance(entry, dict):
            raise ValueError(f"{wrong} its state[{key!r}] is {_describe(entry)}, not a dict of one parameter's state")
    return obj


# each RNG state a Trainer's rng_state.pth may hold that the import sets, checked on a generator of its own
RNG_CHECKS = {
    "cpu": ("a torch CPU", lambda state: torch.Generator().set_state(state)),
    "numpy": ("a numpy", lambda state: np.random.RandomState().set_state(state)),
    "python": ("a Python random", lambda state: random.Random().setstate(state)),
}


def _rng_states(obj: Any, path: str) -> dict:
    """A Trainer's ``rng_state.pth``: a dict whose ``cpu``, ``numpy`` and ``python``
    states (where present) this process could take."""
    if not isinstance(obj, dict):
        raise ValueError(f"cannot import {path}: expected a Trainer's RNG states (a dict: cpu, numpy, python, ...), "
                         f"found {_describe(obj)}")
    for key, (what, check) in RNG_CHECKS.items():
        if key in obj:
            try:
                check(obj[key])
            except (TypeError, ValueError, RuntimeError, IndexError, KeyError, OverflowError) as exc:
                raise ValueError(f"cannot import {path}: its {key!r} entry is not {what} RNG state "
                                 f"({first_line(exc)})") from None
    return obj


def read_transformers(folder: str) -> Contents:
    """A transformers folder: weights (one file or shards listed by an index), and for
    a Trainer's checkpoint the optimizer, scheduler, scaler, RNG and trainer state."""
    model: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        weights = load_weights(path)
        twice = next((name for name in weights if name in model), None)
        if twice is not None:
            raise ValueError(f"cannot import {folder}: tensor {twice!r} is in {os.path.basename(path)} and an "
                             "earlier shard; which one is the model's?")
        model.update(weights)
    optimizer, extra = None, {}
    path = _member(folder, HF_OPTIMIZER)
    if path is not None:
        optimizer = _optimizer_state(load_torch(path), path)
    for name, key in ((HF_SCHEDULER, "scheduler"), (HF_SCALER, "scaler")):
        path = _member(folder, name)
        if path is not None:
            extra[key] = load_torch(path)
    for name, key in HF_JSON_EXTRAS.items():
        path = _member(folder, name)
        if path is not None:
            extra[key] = read_json(path)
    path = _member(folder, HF_RNG)
    rng = None if path is None else _rng_states(load_torch(path), path)
    return Contents(model, optimizer, extra, rng)


def _member(folder: str, name: str) -> str | None:
    """The path of the file ``name`` of ``folder``, None where the folder has none;
    refused where it is no regular file (see :func:`.check_regular`). It may be a link
    out of the folder: a Hugging Face hub cache snapshot is a folder of links into the
    cache's ``blobs/``, and the user named the folder to read."""
    path = os.path.join(folder, name)
    return check_regular(path) if os.path.lexists(path) else None


def _weight_files(folder: str) -> list[str]:
    for name in HF_WEIGHTS:
        path = _member(folder, name)
        if path is not None:
            return [path]
    index_name = next(n for n in HF_INDEXES if _member(folder, n) is not None)
    index = read_json(os.path.join(folder, index_name))
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"cannot import {folder}: {index_name} has no weight_map")
    files = []
    for shard in dict.fromkeys(weight_map.values()):
        if not isinstance(shard, str) or os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise ValueError(f"cannot import {folder}: {index_name} names the shard {shard!r}, "
                             "not a file of the folder")
        path = _member(folder, shard)
        if path is None:
            raise OSError(f"cannot read {os.path.join(folder, shard)}: {index_name} lists it, and there is no "
                          "such file")
        files.append(path)
    return files
